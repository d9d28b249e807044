"""KL to the reference: Schulman's per-token estimators, and the KL-shaped per-token rewards of PPO and
REINFORCE++.

Pure, jittable functions of float32 arrays; the estimator's name is static. Shapes: ``[B, T]`` per-token arrays
with ``mask [B, T]`` (1 = completion token). Formulas and references: ``docs/algorithms.md``.
"""

from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.options import KL_ESTIMATORS
from jaxrl_llm.rl.reductions import MAX_LOG_RATIO, as_float32, is_valid

KLEstimator = Literal["k1", "k2", "k3"]


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
    d = as_float32(ref_logp) - as_float32(logp)
    if mask is not None:
        d = jnp.where(is_valid(mask), d, 0.0)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * jnp.square(d)
    elif estimator == "k3":
        d = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        # exp(d) - d - 1 loses every digit for small |d| in float32 (d = 6e-8 gave -6e-8), and XLA's expm1
        # keeps too few (1e-5 relative at |d| = 0.01): below |d| = 0.1 the Taylor series
        # d^2 (1/2 + d/6 + d^2/24 + d^3/120 + d^4/720) (truncation < 1e-8 relative) is exact to float32 and
        # >= 0, as the formula is.
        taylor = jnp.square(d) * (0.5 + d * (1 / 6 + d * (1 / 24 + d * (1 / 120 + d / 720))))
        kl = jnp.where(jnp.abs(d) < 0.1, taylor, jnp.maximum(jnp.expm1(d) - d, 0.0))
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl


def last_token_mask(mask: Array) -> Array:
    """One-hot ``[B, T]`` float32 marking each row's last valid token (all zero for an empty row)."""
    valid = is_valid(mask)
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
    shaped = -jnp.asarray(kl_coef, jnp.float32) * kl + as_float32(scores)[..., None] * last_token_mask(mask)
    return jax.lax.stop_gradient(jnp.where(is_valid(mask), shaped, 0.0))
