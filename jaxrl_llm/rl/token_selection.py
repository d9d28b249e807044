"""Token selection: which tokens carry the policy gradient, options of the composed loss for every surrogate.
The top-entropy "forking" tokens (Wang et al. 2025), and Clip-Cov / KL-Cov over the covariance of log-prob and
advantage (Cui et al. 2025). Counts and ranks are over the whole (micro-)batch a call sees; the selection is exact
and deterministic. Shapes: ``[B, T]`` with ``mask [B, T]``; fractions and bounds are static.
"""

import jax
import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.reductions import as_float32, is_valid, masked_count, masked_mean

# Counts such as ceil(q * n) are taken in float32: q * n carries a relative error below 2^-23, and shrinking (or
# growing) it by 2^-22 keeps an exact integer q * n from rounding to the next count.
_COUNT_SLACK = 2.0**-22


def _top_ranked(score: Array, eligible: Array, count: Array) -> Array:
    """``[B, T]`` bool: the ``count`` eligible tokens of highest ``score`` (fewer if fewer are eligible), ties
    broken by position (row-major), never an ineligible one. ``count`` may be traced; the selection is exact."""
    flat = jnp.where(eligible, -jax.lax.stop_gradient(as_float32(score)), jnp.inf).reshape(-1)
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
    valid = is_valid(mask)
    count = jnp.ceil(quantile * masked_count(valid) * (1.0 - _COUNT_SLACK))
    return _top_ranked(entropy, valid, count)


def token_covariance(logp: Array, advantages: Array, mask: Array) -> Array:
    """Per-token covariance of log-prob and advantage (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning
    LMs", arXiv:2505.22617, the term that drives the entropy change)::

        cov_t = (A_t - mean(A)) * (log pi(y_t) - mean(log pi))        means over the valid tokens

    No gradient (it only chooses tokens); 0 at padding. As verl's ``clip_cov`` / ``kl_cov``.
    Shapes: ``logp``, ``advantages``, ``mask`` ``[B, T]`` -> ``[B, T]`` float32.
    """
    valid = is_valid(mask)
    logp = jnp.where(valid, jax.lax.stop_gradient(as_float32(logp)), 0.0)
    adv = jnp.where(valid, jax.lax.stop_gradient(as_float32(advantages)), 0.0)
    cov = (adv - masked_mean(adv, valid)) * (logp - masked_mean(logp, valid))
    return jnp.where(valid, cov, 0.0)


def _cov_count(mask: Array, fraction: float) -> Array:
    """verl's ``max(int(fraction * n), 1)`` tokens of the ``n`` valid ones."""
    return jnp.maximum(jnp.floor(fraction * masked_count(is_valid(mask)) * (1.0 + _COUNT_SLACK)), 1.0)


def clip_cov_token_mask(cov: Array, mask: Array, eligible: Array, *, fraction: float, lower: float,
                        upper: float) -> Array:
    """Clip-Cov's tokens (Cui et al. 2025; verl ``clip_cov``): ``max(floor(fraction * n), 1)`` of the eligible
    valid tokens with ``lower < cov_t < upper``, those of highest covariance (verl and the paper draw them uniformly
    from that band; taking the highest is deterministic and needs no random key). ``eligible`` excludes the tokens
    the surrogate has already clipped. Shapes: ``[B, T]`` -> ``[B, T]`` bool."""
    band = is_valid(mask) & eligible & (cov > lower) & (cov < upper)
    return _top_ranked(cov, band, _cov_count(mask, fraction))


def kl_cov_token_mask(cov: Array, mask: Array, *, fraction: float) -> Array:
    """KL-Cov's tokens (Cui et al. 2025; verl ``kl_cov``): the ``max(floor(fraction * n), 1)`` valid tokens of
    highest covariance. Shapes: ``[B, T]`` -> ``[B, T]`` bool."""
    return _top_ranked(cov, is_valid(mask), _cov_count(mask, fraction))


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
