"""The composed policy loss of PPO / GRPO / DAPO / Dr.GRPO / GSPO / CISPO / SAPO: a registered surrogate
(`jaxrl_llm.rl.surrogates`), the token options (`token_selection`, `rollout_correction`), then the KL and entropy
terms, aggregated (`reductions.aggregate_loss`), with metrics.

Every static option is one frozen object, `PolicyLossOptions` (a run's `rl.loss` section, defined with its defaults
and allowed values in `jaxrl_llm.rl.options`); the surrogate's own keywords are `settings` (a run's
`rl.policy_loss_kwargs`). Coefficients (`kl_coef`, `entropy_coef`) and the global counts may be traced.
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.kl import kl_penalty
from jaxrl_llm.rl.options import PolicyLossOptions
from jaxrl_llm.rl.reductions import AggregationMode, aggregate_loss, as_float32, masked_mean
from jaxrl_llm.rl.rollout_correction import ROLLOUT_CORRECTION_MODES, rollout_corrected_surrogate
from jaxrl_llm.rl.surrogates import broadcast_advantages, clip_metrics, policy_surrogate, token_log_ratio
from jaxrl_llm.rl.token_selection import (
    clip_cov_surrogate,
    kl_cov_surrogate,
    token_covariance,
    top_entropy_surrogate,
)

__all__ = ["PolicyLossOptions", "clipped_policy_loss", "compose_policy_loss", "token_options_surrogate"]


def compose_policy_loss(
    surrogate: Array,
    mask: Array,
    *,
    kl: Array | None = None,
    kl_coef: float | Array = 0.0,
    entropy: Array | None = None,
    entropy_coef: float | Array = 0.0,
    aggregation: AggregationMode = "token-mean",
    max_len: int | None = None,
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """``aggregate(l) + kl_coef * aggregate(KL) - entropy_coef * aggregate(H)`` (each term aggregated on its own,
    the same since aggregation is linear), and the metrics ``policy_loss``, ``kl``, ``entropy`` (means over
    valid tokens) of the terms given. Shapes: ``surrogate, mask, kl, entropy [B, T]``."""
    agg = dict(mode=aggregation, max_len=max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    pg_loss = aggregate_loss(surrogate, mask, **agg)
    loss, metrics = pg_loss, {"policy_loss": pg_loss}
    if kl is not None:
        loss = loss + jnp.asarray(kl_coef, jnp.float32) * aggregate_loss(kl, mask, **agg)
        metrics["kl"] = masked_mean(kl, mask)
    if entropy is not None:
        loss = loss - jnp.asarray(entropy_coef, jnp.float32) * aggregate_loss(entropy, mask, **agg)
        metrics["entropy"] = masked_mean(entropy, mask)
    return loss, metrics


def token_options_surrogate(
    token_loss: Array, ratio: Array, log_ratio: Array, logp: Array, adv: Array, mask: Array, o: PolicyLossOptions,
    *, entropy: Array | None = None, old_logp: Array | None = None, sampler_logp: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The surrogate ``[B, T]`` after the token options of ``o``, in order: Clip-Cov, KL-Cov (both on the covariance
    of log-prob and advantage), the top-entropy selection, and the rollout correction when ``sampler_logp`` is
    given; with the metrics of those that are on (`clipped_policy_loss` has the formulas)."""
    metrics: dict[str, Array] = {}
    cov = token_covariance(logp, adv, mask) if o.clip_cov_ratio > 0 or o.kl_cov_ratio > 0 else None
    if o.clip_cov_ratio > 0:
        token_loss, metrics["clip_cov_fraction"] = clip_cov_surrogate(
            token_loss, ratio, cov, adv, mask, epsilon_low=o.epsilon_low, epsilon_high=o.epsilon_high,
            fraction=o.clip_cov_ratio, lower=o.clip_cov_lb, upper=o.clip_cov_ub)
    if o.kl_cov_ratio > 0:
        token_loss, metrics["kl_cov_fraction"] = kl_cov_surrogate(token_loss, log_ratio, cov, mask,
                                                                  fraction=o.kl_cov_ratio, coef=o.kl_cov_coef)
    if o.top_entropy_quantile < 1.0:
        token_loss, metrics["top_entropy_fraction"] = top_entropy_surrogate(token_loss, entropy, mask,
                                                                            quantile=o.top_entropy_quantile)
    if sampler_logp is not None:
        if o.rollout_correction not in ROLLOUT_CORRECTION_MODES:
            raise ValueError(f"sampler_logp weights the loss only under a rollout correction of "
                             f"{', '.join(ROLLOUT_CORRECTION_MODES)}; options.rollout_correction is "
                             f"{o.rollout_correction!r}")
        token_loss, is_metrics = rollout_corrected_surrogate(token_loss, old_logp, sampler_logp, mask,
                                                             mode=o.rollout_correction, cap=o.rollout_correction_cap)
        metrics.update(is_metrics)
    return token_loss, metrics


def clipped_policy_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, options: PolicyLossOptions | None = None,
    *, surrogate: str = "ppo_clip", settings: Mapping[str, Any] | None = None, ref_logp: Array | None = None,
    kl_coef: float | Array = 0.0, entropy: Array | None = None, entropy_coef: float | Array = 0.0,
    sampler_logp: Array | None = None, max_len: int | None = None, num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The policy loss: a registered surrogate, the token options of ``options``, composed with KL and entropy
    terms, with metrics. Per token, with ``o = options`` (the defaults when None)::

        s_t   = policy_surrogate(surrogate, settings)_t  "ppo_clip", "gspo", "cispo", "sapo" or a registered name
        s_t   = clip_cov_surrogate(s)_t                  if o.clip_cov_ratio > 0  (0 on Clip-Cov's tokens)
        s_t   = kl_cov_surrogate(s)_t                    if o.kl_cov_ratio > 0    (+ o.kl_cov_coef |log rho_t|)
        s_t   = top_entropy_surrogate(s)_t               if o.top_entropy_quantile < 1  (0 off the selection)
        s_t   = rollout_corrected_surrogate(s)_t         if sampler_logp given  (* w_t, TIS / MIS of
                                                         o.rollout_correction, capped at o.rollout_correction_cap)
        loss  = compose_policy_loss(s, KL(pi || pi_ref) by o.kl_estimator if ref_logp given, H = entropy)
              = aggregate(s) + kl_coef * aggregate(KL) - entropy_coef * aggregate(H)    by o.aggregation

    ``o.epsilon_low`` / ``o.epsilon_high``: the (asymmetric, DAPO 0.2 / 0.28) clip range; ``o.dual_clip_c``: the
    dual clip (Ye et al. 2019; 0 = off). The token options count and rank over the (micro-)batch this call sees.
    ``advantages`` may be ``[B]`` or ``[B, T]`` (`broadcast_advantages`). Log-ratios are clipped to ``[-20, 20]``
    before ``exp`` and padded positions are neutralised before any ``exp``. ``max_len``: the constant of
    ``seq-mean-token-sum-norm`` (default ``T``). Metrics (no gradient): ``policy_loss``, `clip_metrics`, ``kl`` /
    ``entropy`` / ``is_weight/*`` when those inputs are given, ``clip_cov_fraction``, ``kl_cov_fraction``,
    ``top_entropy_fraction`` when those options are on. Static: ``options``, ``surrogate``, ``settings``,
    ``max_len``. Shapes: ``logp``, ``old_logp``, ``mask`` (``ref_logp``, ``entropy``, ``sampler_logp``) ``[B, T]``
    -> (float32 scalar loss, metrics)."""
    o = PolicyLossOptions() if options is None else options
    logp = as_float32(logp)
    adv = broadcast_advantages(advantages, logp)
    clip = dict(epsilon_low=o.epsilon_low, epsilon_high=o.epsilon_high, dual_clip_c=o.dual_clip_c or None)
    token_loss, ratio = policy_surrogate(logp, old_logp, adv, mask, surrogate=surrogate, **clip, settings=settings)
    log_ratio = token_log_ratio(logp, old_logp, mask)
    token_loss, metrics = token_options_surrogate(token_loss, ratio, log_ratio, logp, adv, mask, o, entropy=entropy,
                                                  old_logp=old_logp, sampler_logp=sampler_logp)
    kl = kl_penalty(logp, ref_logp, estimator=o.kl_estimator, mask=mask) if ref_logp is not None else None  # type: ignore[arg-type]
    loss, terms = compose_policy_loss(token_loss, mask, kl=kl, kl_coef=kl_coef, entropy=entropy,
                                      entropy_coef=entropy_coef, aggregation=o.aggregation,  # type: ignore[arg-type]
                                      max_len=max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics.update(terms)
    metrics.update(clip_metrics(ratio, log_ratio, adv, mask, **clip))
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
