"""Policy, value and preference losses and the per-token KL estimators.

Pure, jittable, vmappable functions of float32 arrays. Strings, ``None``-or-not options and aggregation
modes are static (mark them with ``static_argnames``); coefficients such as ``kl_coef`` may be traced
(e.g. from the adaptive KL controller). Shapes: ``[B, T]`` per-token arrays with ``mask [B, T]``
(1 = completion token). Formulas and references: ``docs/algorithms.md``.
"""

from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.logprobs import (
    AggregationMode,
    aggregate_loss,
    masked_count,
    masked_max,
    masked_mean,
    masked_min,
    masked_var,
)

KLEstimator = Literal["k1", "k2", "k3"]
PreferenceLossType = Literal["sigmoid", "ipo", "hinge", "simpo"]

# exp() of a log-ratio beyond this is numerically meaningless (e^20 ~ 5e8) and only risks inf / nan.
_MAX_LOG_RATIO = 20.0


def _f32(x: Array) -> Array:
    return jnp.asarray(x).astype(jnp.float32)


def _valid(mask: Array) -> Array:
    return jnp.asarray(mask) > 0


# --------------------------------------------------------------------------------------------------------
# KL estimators and reward shaping
# --------------------------------------------------------------------------------------------------------


def kl_penalty(
    logp: Array,
    ref_logp: Array,
    *,
    estimator: KLEstimator = "k3",
    clamp: float | None = None,
    mask: Array | None = None,
) -> Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman 2020).

    With ``d = ref_logp - logp = log(pi_ref(y_t) / pi(y_t))``::

        k1 = -d = logp - ref_logp                   unbiased, can be negative, high variance
        k2 = 0.5 * d^2                              >= 0, biased, low variance; its gradient is that of KL
        k3 = exp(d) - d - 1                         >= 0, unbiased, low variance ("low_var_kl")

    All three are 0 when ``pi = pi_ref``. For k3 ``d`` is clipped to ``[-20, 20]`` before ``exp`` so a
    wild token cannot overflow. ``clamp`` (static) clips the estimate to ``[-clamp, clamp]``. With a
    ``mask`` the inputs at padded positions are replaced before any ``exp`` (so garbage there cannot
    produce a NaN gradient) and the output is 0 there.

    Shapes: ``logp``, ``ref_logp``, ``mask`` ``[B, T]`` -> ``[B, T]`` float32.
    """
    d = _f32(ref_logp) - _f32(logp)
    if mask is not None:
        d = jnp.where(_valid(mask), d, 0.0)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * jnp.square(d)
    elif estimator == "k3":
        d = jnp.clip(d, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        # exp(d) - d - 1 loses every digit for small |d| in float32 (d = 6e-8 gave -6e-8), and XLA's expm1
        # keeps too few (1e-5 relative at |d| = 0.01): below |d| = 0.1 the Taylor series
        # d^2 (1/2 + d/6 + d^2/24 + d^3/120 + d^4/720) (truncation < 1e-8 relative) is exact to float32 and
        # >= 0, as the formula is.
        taylor = jnp.square(d) * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d / 720))))
        kl = jnp.where(jnp.abs(d) < 0.1, taylor, jnp.maximum(jnp.expm1(d) - d, 0.0))
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl


def last_token_mask(mask: Array) -> Array:
    """One-hot ``[B, T]`` float32 marking each row's last valid token (all zero for an empty row)."""
    valid = _valid(mask)
    t = valid.shape[-1]
    last = t - 1 - jnp.argmax(jnp.flip(valid, axis=-1), axis=-1)
    return jax.nn.one_hot(last, t, dtype=jnp.float32) * jnp.any(valid, axis=-1, keepdims=True)


def kl_shaped_token_rewards(
    scores: Array,
    logp: Array,
    ref_logp: Array,
    mask: Array,
    *,
    kl_coef: float | Array,
    estimator: KLEstimator = "k1",
    clamp: float | None = None,
) -> Array:
    """Per-token rewards for PPO / REINFORCE++ (Ziegler et al. 2019; Ouyang et al. 2022; Hu 2025).

    ::

        r_t = -kl_coef * KL_t + [t = last valid token] * score

    with ``KL_t = kl_penalty(logp, ref_logp, estimator)`` (k1 by default, as in the papers). The log-probs
    are those stored at rollout time (no gradient flows through a reward).

    Shapes: ``scores [B]``, ``logp``, ``ref_logp``, ``mask`` ``[B, T]`` -> ``[B, T]`` float32, 0 at padding.
    """
    kl = kl_penalty(logp, ref_logp, estimator=estimator, clamp=clamp, mask=mask)
    shaped = -jnp.asarray(kl_coef, jnp.float32) * kl + _f32(scores)[..., None] * last_token_mask(mask)
    return jax.lax.stop_gradient(jnp.where(_valid(mask), shaped, 0.0))


# --------------------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------------------


def clipped_surrogate(
    ratio: Array,
    advantages: Array,
    *,
    epsilon_low: float | Array = 0.2,
    epsilon_high: float | Array = 0.2,
    dual_clip_c: float | None = None,
) -> Array:
    """Per-token PPO clipped surrogate *loss* (Schulman et al. 2017), asymmetric and optionally dual-clipped.

    ::

        l = -min(rho * A, clip(rho, 1 - epsilon_low, 1 + epsilon_high) * A)
        dual clip (Ye et al. 2019), for A < 0 only:  l = min(l, -c * A),  c > 1

    ``epsilon_high > epsilon_low`` is DAPO's clip-higher (Yu et al. 2025). Where the clipped branch is
    active the loss is constant in ``rho`` and the token contributes no gradient. ``dual_clip_c`` is static.

    Shapes: ``ratio``, ``advantages`` broadcastable, e.g. ``[B, T]`` -> ``[B, T]`` float32.
    """
    ratio = _f32(ratio)
    adv = _f32(advantages)
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        if dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip_c * adv), loss)
    return loss


def truncated_importance_weights(
    old_logp: Array, sampler_logp: Array, mask: Array, *, cap: float | None = 2.0
) -> Array:
    """Truncated importance-sampling weights for a sampler / trainer mismatch (Yao et al. 2025), token level:
    ``w_t = stop_gradient(min(pi_old(y_t) / pi_sampler(y_t), cap))``; ``cap=None`` leaves them untruncated.
    ``rollout_correction_weights(..., mode="token_truncate")``. Shapes ``[B, T]`` -> ``[B, T]`` float32."""
    return rollout_correction_weights(old_logp, sampler_logp, mask, mode="token_truncate", cap=cap)


ROLLOUT_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_correction_weights(
    old_logp: Array, sampler_logp: Array, mask: Array, *, mode: str = "token_truncate", cap: float | None = 3.0,
) -> Array:
    """Importance weights that correct a sampler / trainer mismatch (TIS and MIS; TRL's
    ``vllm_importance_sampling_mode``, whose names ``mode`` takes, and verl's ``rollout_is``), multiplied into the
    policy-gradient term::

        token_*:     log rho_t = log pi_old(y_t) - log pi_sampler(y_t)
        sequence_*:  log rho_t = sum_{s valid} (log pi_old(y_s) - log pi_sampler(y_s))   (the same for every t)
        *_truncate:  w_t = min(rho_t, cap)                  (TIS, Yao et al. 2025; cap=None: w_t = rho_t)
        *_mask:      w_t = rho_t if rho_t <= cap else 0     (masked IS: the token / sequence leaves the gradient)

    ``pi_old`` is the trainer's recomputation of the behaviour policy, ``pi_sampler`` what the sampler reported.
    Log-ratios are clipped to [-20, 20] before ``exp``; the weights are stop-gradient, 0 at padding.
    Shapes: ``old_logp``, ``sampler_logp``, ``mask`` ``[B, T]`` -> ``[B, T]`` float32. Static: ``mode``, ``cap``.
    """
    if mode not in ROLLOUT_CORRECTION_MODES or (cap is None and mode.endswith("_mask")):
        raise ValueError(f"rollout correction {mode!r} (cap {cap}): expected one of "
                         f"{', '.join(ROLLOUT_CORRECTION_MODES)}, and a cap for the masking modes")
    valid = _valid(mask)
    log_rho = jnp.where(valid, _f32(old_logp) - _f32(sampler_logp), 0.0)
    if mode.startswith("sequence"):
        log_rho = jnp.broadcast_to(log_rho.sum(axis=-1, keepdims=True), log_rho.shape)
    rho = jnp.exp(jnp.clip(log_rho, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if mode.endswith("_mask"):
        w = jnp.where(rho <= cap, rho, 0.0)
    else:
        w = rho if cap is None else jnp.minimum(rho, cap)
    return jax.lax.stop_gradient(jnp.where(valid, w, 0.0))


def logprob_mismatch(trainer_logp: Array, sampler_logp: Array, mask: Array) -> dict[str, Array]:
    """How far the sampler's log-probs are from the trainer's for the same tokens and weights::

        mismatch/logprob_abs_mean = mean_t |d_t|,  mismatch/logprob_abs_max = max_t |d_t|,
        mismatch/ratio_std        = std_t exp(d_t)   (the spread of the importance ratio at mu = 1, where it
                                                      would be exactly 1 without a mismatch)

    with ``d_t = log pi_trainer(y_t) - log pi_sampler(y_t)`` over valid tokens. Shapes ``[B, T]`` -> scalars.
    """
    valid = _valid(mask)
    d = jnp.where(valid, _f32(trainer_logp) - _f32(sampler_logp), 0.0)
    n = jnp.maximum(valid.sum(), 1)
    ratio = jnp.exp(jnp.clip(d, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    mean_ratio = jnp.where(valid, ratio, 0.0).sum() / n
    var = jnp.where(valid, (ratio - mean_ratio) ** 2, 0.0).sum() / n
    return {"mismatch/logprob_abs_mean": jnp.abs(d).sum() / n, "mismatch/logprob_abs_max": jnp.abs(d).max(),
            "mismatch/ratio_std": jnp.sqrt(var)}


# A policy loss maps the token log-probs to a per-token surrogate loss and the importance ratio it used:
#
#     fn(logp, old_logp, advantages, mask, *, epsilon_low, epsilon_high, dual_clip_c) -> (loss [B, T], ratio [B, T])
#
# with `advantages [B, T]` and log-ratios already clipped to [-20, 20] at valid positions (0 at padding).
# `register_policy_loss("name")` makes one a choice of `rl.policy_loss`; `compose_policy_loss` adds the rest.
PolicyLossFn = Callable[..., tuple[Array, Array]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: `@register_policy_loss("name")` adds `fn` (the signature above) to `POLICY_LOSSES`."""
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return add


def _token_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    log_ratio = jnp.where(_valid(mask), _f32(logp) - _f32(old_logp), 0.0)
    return jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _with_ratio(ratio: Array, advantages: Array, epsilon_low: float | Array, epsilon_high: float | Array,
                dual_clip_c: float | None) -> tuple[Array, Array]:
    """``(clipped_surrogate(rho, A), rho)``: what a surrogate that clips its ratio ``rho`` returns."""
    return clipped_surrogate(ratio, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                             dual_clip_c=dual_clip_c), ratio


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                  epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
                  dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """Token-level clipped surrogate (PPO, GRPO, DAPO, Dr.GRPO): ``rho_t = pi(y_t) / pi_old(y_t)``,
    ``l_t = clipped_surrogate(rho_t, A_t)``. Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    ratio = jnp.exp(_token_log_ratio(logp, old_logp, mask))
    return _with_ratio(ratio, advantages, epsilon_low, epsilon_high, dual_clip_c)


@register_policy_loss("gspo")
def gspo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
              dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """Sequence-level clipped surrogate, GSPO (Zheng et al. 2025)::

        s_i   = exp(mean_t log(pi(y_t) / pi_old(y_t)))          over the valid tokens of sequence i
        rho_t = sg(s_i) * pi(y_t) / sg(pi(y_t))                  value s_i, gradient of log pi(y_t) scaled by s_i
        l_t   = clipped_surrogate(rho_t, A_t)

    With a sequence-level advantage and ``aggregation="seq-mean-token-mean"`` this is exactly GSPO's gradient.
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    sg = jax.lax.stop_gradient
    seq_log_ratio = masked_mean(_token_log_ratio(logp, old_logp, mask), mask, axis=-1, keepdims=True)
    ratio = jnp.exp(sg(seq_log_ratio) + jnp.where(_valid(mask), _f32(logp) - sg(_f32(logp)), 0.0))
    return _with_ratio(ratio, advantages, epsilon_low, epsilon_high, dual_clip_c)


@register_policy_loss("cispo")
def cispo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
               epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
               dual_clip_c: float | None = None) -> tuple[Array, Array]:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, MiniMax 2025, arXiv:2506.13585)::

        rho_t = pi(y_t) / pi_old(y_t)
        w_t   = sg(clip(rho_t, 1 - epsilon_low, 1 + epsilon_high))
        l_t   = -w_t * A_t * log pi(y_t)            grad l_t = -w_t * A_t * grad log pi(y_t)

    The importance weight is clipped, not the update: every valid token with ``A_t != 0`` keeps a gradient
    (``ppo_clip`` drops the tokens on the clipped side), and inside the clip range the gradient is ``ppo_clip``'s.
    As verl's ``compute_policy_loss_cispo``. TRL's ``loss_type="cispo"`` clips only above, reading its
    ``epsilon_high`` as the bound itself (ScaleRL's ``eps_max = 5``): here that is ``epsilon_low >= 1`` (no lower
    bound, as ``rho > 0``) and ``epsilon_high = eps_max - 1``. The value weighs log-probs, so it is not comparable
    with ``ppo_clip``'s; only its gradient matters. No dual clip (``dual_clip_c`` must be None).
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    if dual_clip_c is not None:
        raise ValueError("cispo clips the importance weight; it has no dual clip (dual_clip_c must be None)")
    valid = _valid(mask)
    ratio = jnp.exp(_token_log_ratio(logp, old_logp, mask))
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    # Padded log-probs may be -inf; 0 there keeps 0 * (-inf) = nan out of the value and the gradient.
    return -weight * _f32(advantages) * jnp.where(valid, _f32(logp), 0.0), ratio


@register_policy_loss("sapo")
def sapo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
              dual_clip_c: float | None = None, tau_pos: float | Array = 1.0,
              tau_neg: float | Array = 1.05) -> tuple[Array, Array]:
    """SAPO, soft adaptive policy optimisation (Gao et al. 2025, arXiv:2511.20347): a smooth gate in place of the
    hard clip, with its own temperature for positive and negative advantages::

        tau_t = tau_pos if A_t > 0 else tau_neg
        f(r)  = sigmoid(tau_t * (r - 1)) * 4 / tau_t
        l_t   = -f(rho_t) * A_t                     grad l_t = -g_t * A_t * rho_t * grad log pi(y_t)
        g_t   = f'(rho_t) = 4 s (1 - s),  s = sigmoid(tau_t * (rho_t - 1))

    ``g = 1`` at ``rho = 1`` (the unclipped policy gradient there), and decays smoothly as ``rho`` leaves 1: a soft
    trust region, sharper for larger ``tau`` (``tau -> inf``: a hard gate that keeps only ``rho = 1``; ``tau -> 0``:
    the unclipped ``-rho A``). ``tau_neg > tau_pos`` damps the updates of negative tokens faster, which the paper
    finds more stable. As TRL's ``loss_type="sapo"`` (``sapo_temperature_pos`` / ``_neg``) and verl's
    ``compute_policy_loss_sapo`` (``tau_pos`` / ``tau_neg``); both recommend ``seq-mean-token-mean`` aggregation.
    ``epsilon_low`` / ``epsilon_high`` are not used; no dual clip (``dual_clip_c`` must be None).
    Shapes: all ``[B, T]`` -> ``([B, T], [B, T])``."""
    if dual_clip_c is not None:
        raise ValueError("sapo's gate replaces the clip; it has no dual clip (dual_clip_c must be None)")
    adv = _f32(advantages)
    ratio = jnp.exp(_token_log_ratio(logp, old_logp, mask))
    tau = jnp.where(adv > 0, jnp.asarray(tau_pos, jnp.float32), jnp.asarray(tau_neg, jnp.float32))
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, ratio


def clip_metrics(ratio: Array, token_log_ratio: Array, advantages: Array, mask: Array, *,
                 epsilon_low: float | Array, epsilon_high: float | Array,
                 dual_clip_c: float | None) -> dict[str, Array]:
    """Diagnostics of a clipped update, means over valid tokens (no gradient)::

        clip_fraction/low  = mean[A < 0 and rho < 1 - epsilon_low]
        clip_fraction/high = mean[A > 0 and rho > 1 + epsilon_high]
        clip_fraction/dual = mean[A < 0 and rho > c],  clip_fraction = low + high
        approx_kl = mean[rho_tok - 1 - log rho_tok]   (k3 estimate of KL(pi_old || pi) from the token log-ratios)
        ratio/mean, ratio/min, ratio/max

    Shapes: all ``[B, T]``."""
    r, tok_lr = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(token_log_ratio)
    low = (advantages < 0) & (r < 1.0 - epsilon_low)
    high = (advantages > 0) & (r > 1.0 + epsilon_high)
    dual = (advantages < 0) & (r > dual_clip_c) if dual_clip_c is not None else jnp.zeros_like(_valid(mask))
    return {
        "clip_fraction": masked_mean(low | high, mask),
        "clip_fraction/low": masked_mean(low, mask),
        "clip_fraction/high": masked_mean(high, mask),
        "clip_fraction/dual": masked_mean(dual, mask),
        "approx_kl": masked_mean(jnp.exp(tok_lr) - 1.0 - tok_lr, mask),
        "ratio/mean": masked_mean(r, mask),
        "ratio/min": masked_min(r, mask),
        "ratio/max": masked_max(r, mask),
    }


# --------------------------------------------------------------------------------------------------------
# Token selection: which tokens carry the policy gradient (options of the composer, for every surrogate)
# --------------------------------------------------------------------------------------------------------

# Counts such as ceil(q * n) are taken in float32: q * n carries a relative error below 2^-23, and shrinking (or
# growing) it by 2^-22 keeps an exact integer q * n from rounding to the next count.
_COUNT_SLACK = 2.0**-22


def _top_ranked(score: Array, eligible: Array, count: Array) -> Array:
    """``[B, T]`` bool: the ``count`` eligible tokens of highest ``score`` (fewer if fewer are eligible), ties
    broken by position (row-major), never an ineligible one. ``count`` may be traced; the selection is exact."""
    flat = jnp.where(eligible, -jax.lax.stop_gradient(_f32(score)), jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True)  # ascending -score: highest score first, ineligible (+inf) last
    rank = jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    return (rank.reshape(eligible.shape) < count) & eligible


def top_entropy_token_mask(entropy: Array, mask: Array, *, quantile: float) -> Array:
    """High-entropy "forking" tokens ("Beyond the 80/20 Rule", Wang et al. 2025, arXiv:2506.01939)::

        selected = the ceil(q * n) valid tokens of highest entropy H_t,   n = number of valid tokens

    over the whole (micro-)batch the loss sees (TRL's ``top_entropy_quantile``; TRL thresholds at
    ``torch.quantile(H, 1 - q)`` and keeps the ties too, here the count is exact, ties broken by position). At least
    one token once ``n >= 1``; padding is never selected. ``quantile`` (static) in ``(0, 1]``.

    Shapes: ``entropy``, ``mask`` ``[B, T]`` -> ``[B, T]`` bool.
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"top-entropy quantile must be in (0, 1], got {quantile}")
    valid = _valid(mask)
    count = jnp.ceil(quantile * masked_count(valid) * (1.0 - _COUNT_SLACK))
    return _top_ranked(entropy, valid, count)


def token_covariance(logp: Array, advantages: Array, mask: Array) -> Array:
    """Per-token covariance of log-prob and advantage (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning
    LMs", arXiv:2505.22617, the term that drives the entropy change)::

        cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))        means over the valid tokens

    No gradient (it only chooses tokens); 0 at padding. As verl's ``clip_cov`` / ``kl_cov``.
    Shapes: ``logp``, ``advantages``, ``mask`` ``[B, T]`` -> ``[B, T]`` float32.
    """
    valid = _valid(mask)
    logp = jnp.where(valid, jax.lax.stop_gradient(_f32(logp)), 0.0)
    adv = jnp.where(valid, jax.lax.stop_gradient(_f32(advantages)), 0.0)
    cov = (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))
    return jnp.where(valid, cov, 0.0)


def _cov_count(mask: Array, fraction: float) -> Array:
    """verl's ``max(int(fraction * n), 1)`` tokens of the ``n`` valid ones."""
    return jnp.maximum(jnp.floor(fraction * masked_count(_valid(mask)) * (1.0 + _COUNT_SLACK)), 1.0)


def clip_cov_token_mask(cov: Array, mask: Array, eligible: Array, *, fraction: float, lower: float,
                        upper: float) -> Array:
    """Clip-Cov's tokens (Cui et al. 2025; verl ``clip_cov``): ``max(floor(fraction * n), 1)`` of the eligible
    valid tokens with ``lower < cov_t < upper``, those of highest covariance (verl and the paper draw them uniformly
    from that band; taking the highest is deterministic and needs no random key). ``eligible`` excludes the tokens
    the surrogate has already clipped. Shapes: ``[B, T]`` -> ``[B, T]`` bool."""
    band = _valid(mask) & eligible & (cov > lower) & (cov < upper)
    return _top_ranked(cov, band, _cov_count(mask, fraction))


def kl_cov_token_mask(cov: Array, mask: Array, *, fraction: float) -> Array:
    """KL-Cov's tokens (Cui et al. 2025; verl ``kl_cov``): the ``max(floor(fraction * n), 1)`` valid tokens of
    highest covariance. Shapes: ``[B, T]`` -> ``[B, T]`` bool."""
    return _top_ranked(cov, _valid(mask), _cov_count(mask, fraction))


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


def broadcast_advantages(advantages: Array, logp: Array) -> Array:
    """One advantage per sequence ``[B]`` spread over its tokens, or per-token ``[B, T]`` as given:
    ``A_t = A`` for every ``t``. Shapes: ``advantages [B]`` or ``[B, T]``, ``logp [B, T]`` -> ``[B, T]`` float32."""
    adv = _f32(advantages)
    if adv.ndim == logp.ndim - 1:
        adv = adv[..., None]
    return jnp.broadcast_to(adv, logp.shape)


def policy_surrogate(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, surrogate: str = "ppo_clip",
                     epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2,
                     dual_clip_c: float | None = None,
                     surrogate_options: Mapping[str, Any] | None = None) -> tuple[Array, Array]:
    """The registered surrogate by name: ``(s_t, rho_t) = POLICY_LOSSES[surrogate](logp, old_logp, A, mask, ...)``,
    with ``surrogate_options`` its extra static keywords (SAPO's ``tau_pos`` / ``tau_neg``).
    Shapes: all ``[B, T]`` -> ``(loss [B, T], ratio [B, T])``. Static: ``surrogate``, ``dual_clip_c``, options."""
    if surrogate not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {surrogate!r}; expected one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[surrogate](logp, old_logp, advantages, mask, epsilon_low=epsilon_low,
                                    epsilon_high=epsilon_high, dual_clip_c=dual_clip_c, **(surrogate_options or {}))


def clip_cov_surrogate(token_loss: Array, ratio: Array, cov: Array, advantages: Array, mask: Array, *,
                       epsilon_low: float | Array, epsilon_high: float | Array, fraction: float, lower: float,
                       upper: float) -> tuple[Array, Array]:
    """Clip-Cov (Cui et al. 2025, verl ``clip_cov``): the surrogate detached on `clip_cov_token_mask`'s tokens::

        clipped_t = (A_t < 0 and rho_t < 1 - epsilon_low) or (A_t > 0 and rho_t > 1 + epsilon_high)
        D         = clip_cov_token_mask(cov, eligible = not clipped, fraction, lower, upper)
        s_t       = 0 if t in D else s_t

    The loss is multiplied by 0 there, as verl's ``corr``, so value and gradient agree (the tokens still count in
    the aggregation's denominator). Returns ``(s [B, T], fraction of the valid tokens in D)``. Shapes: ``[B, T]``.
    """
    # Tokens on the clipped side of the PPO range have no gradient already; verl leaves them out of the draw.
    r = jax.lax.stop_gradient(ratio)
    clipped = ((advantages < 0) & (r < 1.0 - epsilon_low)) | ((advantages > 0) & (r > 1.0 + epsilon_high))
    detached = clip_cov_token_mask(cov, mask, ~clipped, fraction=fraction, lower=lower, upper=upper)
    return jnp.where(detached, 0.0, token_loss), masked_mean(detached, mask)


def kl_cov_surrogate(token_loss: Array, token_log_ratio: Array, cov: Array, mask: Array, *, fraction: float,
                     coef: float | Array) -> tuple[Array, Array]:
    """KL-Cov (Cui et al. 2025, verl ``kl_cov``; ``coef`` is verl's ``ppo_kl_coef``)::

        s_t += coef * |log pi(y_t) - log pi_old(y_t)|     on the tokens of kl_cov_token_mask(cov, fraction)

    verl applies it to the unclipped ``-rho A``; here to whichever surrogate. Returns ``(s [B, T], fraction of
    the valid tokens penalised)``. Shapes: ``[B, T]``."""
    penalised = kl_cov_token_mask(cov, mask, fraction=fraction)
    penalty = jnp.asarray(coef, jnp.float32) * jnp.abs(token_log_ratio)
    return token_loss + jnp.where(penalised, penalty, 0.0), masked_mean(penalised, mask)


def top_entropy_surrogate(token_loss: Array, entropy: Array | None, mask: Array, *,
                          quantile: float) -> tuple[Array, Array]:
    """The policy-gradient term only on the ``ceil(q n)`` highest-entropy valid tokens ("Beyond the 80/20 Rule")::

        s_t = s_t if t in top_entropy_token_mask(H, quantile) else 0

    The others still count in the aggregation's denominator, as in the paper and TRL. Returns ``(s [B, T],
    fraction of the valid tokens selected)``. Shapes: ``[B, T]``. Static: ``quantile``."""
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 selects tokens by entropy: pass entropy=[B, T]")
    selected = top_entropy_token_mask(entropy, mask, quantile=quantile)
    return jnp.where(selected, token_loss, 0.0), masked_mean(selected, mask)


def rollout_corrected_surrogate(token_loss: Array, old_logp: Array, sampler_logp: Array, mask: Array, *,
                                mode: str, cap: float | None) -> tuple[Array, dict[str, Array]]:
    """``s_t = w_t * s_t`` with ``w_t = rollout_correction_weights(old_logp, sampler_logp, mode, cap)``, the
    sampler / trainer mismatch correction (TIS / MIS). Metrics: ``is_weight/mean`` and, for the masking modes,
    ``is_weight/masked_fraction``. Shapes: ``[B, T]``. Static: ``mode``, ``cap``."""
    weights = rollout_correction_weights(old_logp, sampler_logp, mask, mode=mode, cap=cap)
    metrics = {"is_weight/mean": masked_mean(weights, mask)}
    if mode.endswith("_mask"):
        metrics["is_weight/masked_fraction"] = masked_mean(weights == 0.0, mask)
    return token_loss * weights, metrics


def clipped_policy_loss(
    logp: Array, old_logp: Array, advantages: Array, mask: Array, *, surrogate: str = "ppo_clip",
    epsilon_low: float | Array = 0.2, epsilon_high: float | Array = 0.2, dual_clip_c: float | None = None,
    surrogate_options: Mapping[str, Any] | None = None, ref_logp: Array | None = None, kl_coef: float | Array = 0.0,
    kl_estimator: KLEstimator = "k3", kl_clamp: float | None = None, entropy: Array | None = None,
    entropy_coef: float | Array = 0.0, sampler_logp: Array | None = None, tis_cap: float | None = None,
    rollout_correction: str = "token_truncate", top_entropy_quantile: float = 1.0, clip_cov_ratio: float = 0.0,
    clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, kl_cov_ratio: float = 0.0, kl_cov_coef: float | Array = 1.0,
    aggregation: AggregationMode = "token-mean", max_len: int | None = None, num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The policy loss of PPO / GRPO / DAPO / Dr.GRPO / GSPO / CISPO / SAPO: a registered surrogate, the token
    options, composed with KL and entropy terms, with metrics. Per token::

        s_t   = policy_surrogate(surrogate)_t            "ppo_clip", "gspo", "cispo", "sapo" or a registered name
        s_t   = clip_cov_surrogate(s)_t                  if clip_cov_ratio > 0  (0 on Clip-Cov's tokens)
        s_t   = kl_cov_surrogate(s)_t                    if kl_cov_ratio > 0    (+ kl_cov_coef |log rho_t|)
        s_t   = top_entropy_surrogate(s)_t               if top_entropy_quantile < 1  (0 off the selection)
        s_t   = rollout_corrected_surrogate(s)_t         if sampler_logp given  (* w_t, TIS / MIS)
        loss  = compose_policy_loss(s, KL(pi || pi_ref) if ref_logp given, H = entropy)
              = aggregate(s) + kl_coef * aggregate(KL) - entropy_coef * aggregate(H)

    ``epsilon_low`` / ``epsilon_high``: the (asymmetric, DAPO 0.2 / 0.28) clip range; ``dual_clip_c``: the dual
    clip (Ye et al. 2019). The token options count and rank over the (micro-)batch this call sees. ``advantages`` may
    be ``[B]`` or ``[B, T]`` (`broadcast_advantages`). Log-ratios are clipped to ``[-20, 20]`` before ``exp`` and
    padded positions are neutralised before any ``exp``. Metrics (no gradient): ``policy_loss``, `clip_metrics`,
    ``kl`` / ``entropy`` / ``is_weight/*`` when those inputs are given, ``clip_cov_fraction``, ``kl_cov_fraction``,
    ``top_entropy_fraction`` when those options are on. Static: every option but the coefficients and ``num_*``.
    Shapes: ``logp``, ``old_logp``, ``mask`` (``ref_logp``, ``entropy``, ``sampler_logp``) ``[B, T]`` -> (float32
    scalar loss, metrics)."""
    logp = _f32(logp)
    adv = broadcast_advantages(advantages, logp)
    clip = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip_c=dual_clip_c)
    token_loss, ratio = policy_surrogate(logp, old_logp, adv, mask, surrogate=surrogate, **clip,
                                         surrogate_options=surrogate_options)
    token_log_ratio = _token_log_ratio(logp, old_logp, mask)
    metrics: dict[str, Array] = {}
    cov = token_covariance(logp, adv, mask) if clip_cov_ratio > 0 or kl_cov_ratio > 0 else None
    if clip_cov_ratio > 0:
        token_loss, metrics["clip_cov_fraction"] = clip_cov_surrogate(
            token_loss, ratio, cov, adv, mask, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
            fraction=clip_cov_ratio, lower=clip_cov_lb, upper=clip_cov_ub)
    if kl_cov_ratio > 0:
        token_loss, metrics["kl_cov_fraction"] = kl_cov_surrogate(token_loss, token_log_ratio, cov, mask,
                                                                  fraction=kl_cov_ratio, coef=kl_cov_coef)
    if top_entropy_quantile < 1.0:
        token_loss, metrics["top_entropy_fraction"] = top_entropy_surrogate(token_loss, entropy, mask,
                                                                            quantile=top_entropy_quantile)
    if sampler_logp is not None:
        token_loss, is_metrics = rollout_corrected_surrogate(token_loss, old_logp, sampler_logp, mask,
                                                             mode=rollout_correction, cap=tis_cap)
        metrics.update(is_metrics)
    kl = kl_penalty(logp, ref_logp, estimator=kl_estimator, clamp=kl_clamp, mask=mask) if ref_logp is not None else None
    loss, terms = compose_policy_loss(token_loss, mask, kl=kl, kl_coef=kl_coef, entropy=entropy,
                                      entropy_coef=entropy_coef, aggregation=aggregation, max_len=max_len,
                                      num_tokens=num_tokens, num_seqs=num_seqs)
    metrics.update(terms)
    metrics.update(clip_metrics(ratio, token_log_ratio, adv, mask, **clip))
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------------------


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
    """``1 - Var[R - V] / Var[R]`` over valid tokens (population variances), float32 scalar.

    1 is a perfect critic, 0 no better than a constant, negative worse. When ``Var[R] = 0`` it is 1 if
    the residual variance is 0 too and 0 otherwise (scikit-learn's convention), never NaN.

    Shapes: ``values``, ``returns``, ``mask`` ``[B, T]``.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(_f32(returns) - _f32(values), mask)
    ratio = var_residual / jnp.where(var_returns > 0, var_returns, 1.0)
    return jnp.where(var_returns > 0, 1.0 - ratio, jnp.where(var_residual > 0, 0.0, 1.0))


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, mask: Array, *, clip_range: float | None = 0.2,
    aggregation: AggregationMode = "token-mean", max_len: int | None = None, num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PPO critic loss with value clipping (Schulman et al. 2017; as in OpenAI baselines' PPO2).

    ::

        V_clip = V_old + clip(V - V_old, -clip_range, clip_range)
        l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)        (0.5 * (V - R)^2 if clip_range is None)
        loss   = aggregate(l, mask, aggregation)

    Metrics: ``value_loss``, ``value_clip_fraction`` (tokens where the clipped term is the larger),
    ``explained_variance`` of the current ``values`` against ``returns``, ``value/mean``.

    Shapes: ``values``, ``old_values``, ``returns``, ``mask`` ``[B, T]``. Returns ``(loss, metrics)``.
    """
    v = _f32(values)
    target = _f32(returns)
    unclipped = jnp.square(v - target)
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_frac = jnp.zeros((), jnp.float32)
    else:
        v_old = _f32(old_values)
        v_clip = v_old + jnp.clip(v - v_old, -clip_range, clip_range)
        clipped = jnp.square(v_clip - target)
        per_token = 0.5 * jnp.maximum(unclipped, clipped)
        clipped_frac = masked_mean(clipped > unclipped, mask)
    loss = aggregate_loss(per_token, mask, aggregation, max_len=max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {
        "value_loss": loss,
        "value_clip_fraction": clipped_frac,
        "explained_variance": explained_variance(v, target, mask),
        "value/mean": masked_mean(v, mask),
    }
    return loss, {k: jax.lax.stop_gradient(m) for k, m in metrics.items()}


# --------------------------------------------------------------------------------------------------------
# Preference (DPO-family) losses
# --------------------------------------------------------------------------------------------------------


def preference_scores(
    policy_chosen_logp: Array, policy_rejected_logp: Array, ref_chosen_logp: Array, ref_rejected_logp: Array, *,
    loss_type: PreferenceLossType = "sigmoid", chosen_lengths: Array | None = None,
    rejected_lengths: Array | None = None,
) -> tuple[Array, Array]:
    """What a DPO-family loss compares per response: the log-ratio to the reference, or SimPO's length-normalised
    log-prob (reference-free)::

        z = log pi(y) - log pi_ref(y)          z = log pi(y) / max(|y|, 1)   (loss_type="simpo")

    Shapes: log-probs and lengths ``[B]`` -> ``(z_chosen [B], z_rejected [B])`` float32. Static: ``loss_type``."""
    if loss_type == "simpo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='simpo' needs chosen_lengths and rejected_lengths")
        chosen = _f32(policy_chosen_logp) / jnp.maximum(_f32(chosen_lengths), 1.0)
        rejected = _f32(policy_rejected_logp) / jnp.maximum(_f32(rejected_lengths), 1.0)
    else:
        chosen = _f32(policy_chosen_logp) - _f32(ref_chosen_logp)
        rejected = _f32(policy_rejected_logp) - _f32(ref_rejected_logp)
    return chosen, rejected


def preference_pair_loss(h: Array, *, beta: Array, label_smoothing: Array, loss_type: PreferenceLossType = "sigmoid",
                         simpo_gamma: float | Array = 0.5) -> Array:
    """Per-pair DPO-family loss of the margin ``h = z_chosen - z_rejected`` (`preference_scores`), ``eps`` the
    label smoothing:

    * ``sigmoid`` (DPO, Rafailov et al. 2023; label smoothing = conservative DPO, Mitchell 2023)::

          l = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    * ``ipo`` (Azar et al. 2023): ``l = (h - 1 / (2 * beta))^2`` (IPO's ``tau`` is ``beta`` here; TRL feeds
      length-averaged log-probs to IPO; pass those if that is wanted).
    * ``hinge`` (SLiC, Zhao et al. 2023): ``l = max(0, 1 - beta * h)``.
    * ``simpo`` (SimPO, Meng et al. 2024), ``h`` the difference of length-normalised log-probs::

          l = -(1 - eps) * log sigmoid(beta * h - gamma) - eps * log sigmoid(gamma - beta * h)

    Shapes: ``h [B]``, ``beta``, ``label_smoothing`` float32 scalars -> ``[B]`` float32. Static: ``loss_type``."""
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -(1.0 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    if loss_type == "simpo":
        z = beta * h - jnp.asarray(simpo_gamma, jnp.float32)
        return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)
    if loss_type == "ipo":
        return jnp.square(h - 1.0 / (2.0 * beta))
    if loss_type == "hinge":
        return jax.nn.relu(1.0 - beta * h)
    raise ValueError(f"unknown loss_type {loss_type!r}; expected 'sigmoid', 'ipo', 'hinge' or 'simpo'")


def dpo_loss(
    policy_chosen_logp: Array, policy_rejected_logp: Array, ref_chosen_logp: Array, ref_rejected_logp: Array, *,
    beta: float | Array = 0.1, loss_type: PreferenceLossType = "sigmoid", label_smoothing: float | Array = 0.0,
    mask: Array | None = None, chosen_lengths: Array | None = None, rejected_lengths: Array | None = None,
    simpo_gamma: float | Array = 0.5,
) -> tuple[Array, dict[str, Array]]:
    """DPO-family preference losses on summed sequence log-probs, with reward metrics::

        z     = preference_scores(...)             log pi - log pi_ref  (SimPO: log pi / |y|, reference-free)
        l     = preference_pair_loss(z_w - z_l)    sigmoid (DPO), ipo, hinge (SLiC) or simpo
        loss  = mean over valid pairs of l

    The implicit rewards are ``beta * z`` per response. Metrics (means over valid pairs, no gradient): ``loss``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (fraction with chosen
    reward strictly above rejected), ``logps/chosen``, ``logps/rejected`` (TRL's names).

    Shapes: all four log-prob inputs ``[B]`` (sums over each response's tokens; ``masked_sum(..., axis=-1)``
    of token log-probs), optional ``mask [B]`` for padding pairs, lengths ``[B]`` (SimPO's, required there).
    Returns ``(loss, metrics)``.
    """
    beta = jnp.asarray(beta, jnp.float32)
    eps = jnp.asarray(label_smoothing, jnp.float32)
    chosen, rejected = preference_scores(policy_chosen_logp, policy_rejected_logp, ref_chosen_logp,
                                         ref_rejected_logp, loss_type=loss_type, chosen_lengths=chosen_lengths,
                                         rejected_lengths=rejected_lengths)
    h = chosen - rejected
    per_pair = preference_pair_loss(h, beta=beta, label_smoothing=eps, loss_type=loss_type, simpo_gamma=simpo_gamma)
    pair_mask = jnp.ones_like(h) if mask is None else mask
    loss = masked_mean(per_pair, pair_mask)
    chosen_reward = beta * chosen
    rejected_reward = beta * rejected
    metrics = {
        "loss": loss,
        "rewards/chosen": masked_mean(chosen_reward, pair_mask),
        "rewards/rejected": masked_mean(rejected_reward, pair_mask),
        "rewards/margins": masked_mean(chosen_reward - rejected_reward, pair_mask),
        "rewards/accuracies": masked_mean(chosen_reward > rejected_reward, pair_mask),
        "logps/chosen": masked_mean(policy_chosen_logp, pair_mask),
        "logps/rejected": masked_mean(policy_rejected_logp, pair_mask),
    }
    return loss, {k: jax.lax.stop_gradient(m) for k, m in metrics.items()}
