"""Rollout correction: the sampler / trainer mismatch, measured and corrected. Importance weights
``pi_old / pi_sampler`` per token or per sequence, truncated (TIS) or masked (MIS), multiplied into the
policy-gradient term; and the mismatch's metrics. Shapes: ``[B, T]`` with ``mask [B, T]``; mode and cap static.
"""

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.options import ROLLOUT_CORRECTIONS
from jaxrl_llm.rl.reductions import MAX_LOG_RATIO, as_float32, is_valid, masked_mean

# The modes that weight the loss; rl.loss.rollout_correction's others (none, recompute) only choose where the old
# policy's log-probs come from.
ROLLOUT_CORRECTION_MODES = tuple(m for m in ROLLOUT_CORRECTIONS if m not in ("none", "recompute"))


def truncated_importance_weights(
    old_logp: Array, sampler_logp: Array, mask: Array, *, cap: float | None = 2.0
) -> Array:
    """Truncated importance-sampling weights for a sampler / trainer mismatch (Yao et al. 2025), token level:
    ``w_t = stop_gradient(min(pi_old(y_t) / pi_sampler(y_t), cap))``; ``cap=None`` leaves them untruncated.
    ``rollout_correction_weights(..., mode="token_truncate")``. Shapes ``[B, T]`` -> ``[B, T]`` float32."""
    return rollout_correction_weights(old_logp, sampler_logp, mask, mode="token_truncate", cap=cap)


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
    valid = is_valid(mask)
    log_rho = jnp.where(valid, as_float32(old_logp) - as_float32(sampler_logp), 0.0)
    if mode.startswith("sequence"):
        log_rho = jnp.broadcast_to(log_rho.sum(axis=-1, keepdims=True), log_rho.shape)
    rho = jnp.exp(jnp.clip(log_rho, -MAX_LOG_RATIO, MAX_LOG_RATIO))
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
    valid = is_valid(mask)
    d = jnp.where(valid, as_float32(trainer_logp) - as_float32(sampler_logp), 0.0)
    n = jnp.maximum(valid.sum(), 1)
    ratio = jnp.exp(jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    mean_ratio = jnp.where(valid, ratio, 0.0).sum() / n
    var = jnp.where(valid, (ratio - mean_ratio) ** 2, 0.0).sum() / n
    return {"mismatch/logprob_abs_mean": jnp.abs(d).sum() / n, "mismatch/logprob_abs_max": jnp.abs(d).max(),
            "mismatch/ratio_std": jnp.sqrt(var)}


# A policy loss maps the token log-probs to a per-token surrogate loss and the importance ratio it used:


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
