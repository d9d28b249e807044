"""Masked reductions and loss aggregation: the float32 sums, means and spreads over valid tokens every loss and
metric in `jaxrl_llm.rl` is built from.

Pure, jittable and vmappable. Shapes: ``x [B, T]`` with ``mask [B, T]`` (1 = the token counts). Masked reductions
*select* (``jnp.where``) rather than multiply, so an ``inf`` or ``nan`` sitting in a padded position cannot leak
into a sum as ``0 * inf = nan``.
"""

from typing import Literal

import jax.numpy as jnp
from jax import Array

from jaxrl_llm.rl.options import LOSS_AGGREGATIONS

AggregationMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATION_MODES: tuple[str, ...] = LOSS_AGGREGATIONS

Axis = int | tuple[int, ...] | None

# exp() of a log-ratio beyond this is numerically meaningless (e^20 ~ 5e8) and only risks inf / nan.
MAX_LOG_RATIO = 20.0


def as_float32(x: Array) -> Array:
    """``x`` as a float32 array."""
    return jnp.asarray(x).astype(jnp.float32)


def is_valid(mask: Array) -> Array:
    """``mask > 0``: the tokens that count (a fractional mask is a weight; 0 is padding)."""
    return jnp.asarray(mask) > 0


def safe_divide(numerator: Array, denominator: Array | float) -> Array:
    """``numerator / denominator`` with a zero denominator replaced by 1.

    Used where a zero denominator means "nothing to average" (every token masked), in which case the
    masked numerator is 0 as well and the result is 0 instead of ``nan``.
    """
    denominator = jnp.asarray(denominator, jnp.float32)
    return numerator / jnp.where(denominator > 0, denominator, 1.0)


def masked_sum(x: Array, mask: Array, axis: Axis = None, *, keepdims: bool = False) -> Array:
    """``sum(x * mask)`` over ``axis`` in float32.

    Shapes: ``x`` and ``mask`` broadcastable, e.g. ``[B, T]``. A fractional mask acts as a weight.
    Padded entries are dropped by selection, so non-finite values there do not matter.
    """
    m = jnp.asarray(mask).astype(jnp.float32)
    x = jnp.asarray(x).astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x * m, 0.0), axis=axis, keepdims=keepdims)


def masked_count(mask: Array, axis: Axis = None, *, keepdims: bool = False) -> Array:
    """``sum(mask)`` over ``axis`` in float32 (the number of valid tokens for a 0/1 mask)."""
    return jnp.sum(jnp.asarray(mask).astype(jnp.float32), axis=axis, keepdims=keepdims)


def masked_mean(x: Array, mask: Array, axis: Axis = None, *, keepdims: bool = False) -> Array:
    """``sum(x * mask) / sum(mask)`` over ``axis``, float32; 0 where every entry is masked.

    Shapes: ``x``, ``mask`` ``[B, T]`` (or broadcastable); ``axis=None`` averages over all valid tokens.
    """
    return safe_divide(masked_sum(x, mask, axis, keepdims=keepdims), masked_count(mask, axis, keepdims=keepdims))


def masked_reference(x: Array, mask: Array, axis: Axis = None) -> Array:
    """The largest valid value over ``axis`` (keepdims), 0 where none is valid: a shift for exact statistics.

    Spreads computed from ``x - masked_reference(x)`` are exactly 0 for values that are all equal (the shift is
    one of them, and a maximum involves no rounding), whatever the reduction order; the mean is shift-invariant.
    """
    x, valid = jnp.broadcast_arrays(jnp.asarray(x).astype(jnp.float32), jnp.asarray(mask) > 0)
    top = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True)
    return jnp.where(jnp.isfinite(top), top, 0.0)


def masked_var(x: Array, mask: Array, axis: Axis = None, *, ddof: int = 0, keepdims: bool = False) -> Array:
    """Masked variance ``sum(mask * (x - mean)^2) / (sum(mask) - ddof)`` in float32.

    ``ddof=0`` is the population (biased) estimator, ``ddof=1`` Bessel's unbiased one. Returns 0 when
    ``sum(mask) <= ddof`` (too few valid entries to estimate a spread).
    """
    # Shifted by one valid value first: equal values have variance exactly 0, near-equal ones keep their digits.
    shifted = jnp.asarray(x).astype(jnp.float32) - masked_reference(x, mask, axis)
    centered = shifted - masked_mean(shifted, mask, axis, keepdims=True)
    sq = masked_sum(jnp.square(centered), mask, axis, keepdims=keepdims)
    count = masked_count(mask, axis, keepdims=keepdims)
    return jnp.where(count > ddof, safe_divide(sq, count - ddof), 0.0)


def masked_max(x: Array, mask: Array, axis: Axis = None) -> Array:
    """Maximum of ``x`` over valid entries (padding replaced by ``-inf``); 0 where all are masked."""
    x = jnp.asarray(x).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    out = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis)
    return jnp.where(jnp.any(valid, axis=axis), out, 0.0)


def masked_min(x: Array, mask: Array, axis: Axis = None) -> Array:
    """Minimum of ``x`` over valid entries (padding replaced by ``+inf``); 0 where all are masked."""
    x = jnp.asarray(x).astype(jnp.float32)
    valid = jnp.asarray(mask) > 0
    out = jnp.min(jnp.where(valid, x, jnp.inf), axis=axis)
    return jnp.where(jnp.any(valid, axis=axis), out, 0.0)


# --------------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------------


def aggregate_loss(
    per_token: Array,
    mask: Array,
    mode: AggregationMode = "token-mean",
    *,
    max_len: int | None = None,
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
) -> Array:
    """Reduce a per-token loss ``[B, T]`` with a completion mask ``[B, T]`` to a float32 scalar.

    With ``m`` the mask, ``L_i = sum_t m_it`` the length of sequence ``i``, ``N = sum_it m_it`` the token
    count and ``S`` the number of sequences with at least one valid token:

    * ``token-mean``              ``sum_it m_it l_it / N``  (DAPO, Yu et al. 2025: every token weighs the same)
    * ``seq-mean-token-mean``     ``(1/S) sum_i (1/L_i) sum_t m_it l_it``  (GRPO, Shao et al. 2024)
    * ``seq-mean-token-sum``      ``(1/S) sum_i sum_t m_it l_it``
    * ``seq-mean-token-sum-norm`` ``(1/S) sum_i sum_t m_it l_it / max_len``  (Dr.GRPO, Liu et al. 2025:
      a constant instead of ``L_i`` removes the length bias). ``max_len`` defaults to ``T``.

    Leading dimensions other than the last are all treated as sequences. Fully masked rows (padding rows
    of a fixed-size batch) count in neither ``N`` nor ``S``.

    Global counts. Under ``jax.jit`` a batch sharded over devices is still one global array, so
    ``mask.sum()`` here is already the global token count and the mean is over the whole batch, not per
    device. The explicit ``num_tokens`` / ``num_seqs`` are for gradient accumulation over micro-batches:
    pass the counts of the *full* batch to each micro-batch call and *sum* the results; the accumulated
    loss and gradient then equal those of the full batch in one call (``token-mean`` uses ``num_tokens``,
    the ``seq-mean-*`` modes use ``num_seqs``).

    Args:
      per_token: loss per token ``[B, T]`` (any float dtype; computed in float32).
      mask: ``[B, T]``, 1 = token counts in the loss.
      mode: one of ``AGGREGATION_MODES`` (static).
      max_len: constant length normaliser for ``seq-mean-token-sum-norm`` (static).
      num_tokens: override of ``N`` for ``token-mean``.
      num_seqs: override of ``S`` for the ``seq-mean-*`` modes.

    Returns:
      float32 scalar.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    if mode == "token-mean":
        denom = masked_count(mask) if num_tokens is None else num_tokens
        return safe_divide(masked_sum(per_token, mask), denom)

    seq_sums = masked_sum(per_token, mask, axis=-1)
    seq_lens = masked_count(mask, axis=-1)
    if mode == "seq-mean-token-mean":
        per_seq = safe_divide(seq_sums, seq_lens)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sums
    else:
        norm = per_token.shape[-1] if max_len is None else max_len
        if norm <= 0:
            raise ValueError(f"max_len must be positive, got {norm}")
        per_seq = seq_sums / float(norm)
    denom = jnp.sum(seq_lens > 0).astype(jnp.float32) if num_seqs is None else num_seqs
    return safe_divide(jnp.sum(per_seq), denom)
