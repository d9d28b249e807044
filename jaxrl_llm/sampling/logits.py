"""One sampling step on a batch of logits `[B, V]`: temperature, top-k / top-p / min-p truncation by bisection on
the float bits (exact, no sort), and a two-level inverse-CDF draw (one uniform per row). Pure, jittable; the
decode loop of `jaxrl_llm.sampling` calls `sample_from_logits` once per token."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.sampling.config import Knobs

#
# XLA on CPU sorts a [B, V] array, or runs `lax.top_k`, 10-100x slower than a decode step, and draws the
# [B, V] Gumbel noise of `jax.random.categorical` several times slower than the rest of the sampling math.
# So thresholds are found by bisection on the float bits (32 masked reductions, exact) and tokens by a
# two-level inverse CDF (one uniform per row): both cost a few passes over [B, V], never a sort.


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (`a < b` iff `f(a) < f(b)`), for exact bisection over floats."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)  # + 0.0 turns -0.0 into +0.0
    negative = (bits >> 31).astype(bool)
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _largest_passing(lo: jax.Array, hi: jax.Array, passes: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest `t` in `[lo, hi]` (uint32 `[B, 1]`) with `passes(t)`, for a `passes` that is true at `lo` and
    monotone (true below some point, false above). 32 halvings of the uint32 range make it exact."""

    def halve(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + gap // 2 + gap % 2  # ceil: mid > lo whenever lo < hi
        ok = passes(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def truncation_threshold(scaled: jax.Array, knobs: Knobs, *, use_top_k: bool, use_top_p: bool,
                         use_min_p: bool) -> jax.Array:
    """Ordered-bits threshold `[B, 1]` uint32: the kept set is `K = {v : _ordered_bits(s_v) >= threshold}`.

    `scaled [B, V]` = logits / temperature. Top-k, then top-p on the top-k-renormalised distribution, then
    min-p (transformers' order); rules in the module docstring. Ties at a threshold are all kept. Each of
    top-k/top-p is one exact bisection, computed only when switched on (static flags).
    """
    ordered = _ordered_bits(scaled)
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    threshold = jnp.min(ordered, axis=-1, keepdims=True)  # keep everything
    top = jnp.max(ordered, axis=-1, keepdims=True)
    if use_top_k:
        # The k-th largest value: the largest t with #{v: s_v >= t} >= k.
        k = jnp.clip(knobs.top_k, 1, scaled.shape[-1])
        threshold = _largest_passing(threshold, top, lambda t: jnp.sum(ordered >= t, -1, keepdims=True) >= k)
    if use_top_p:
        # The smallest value whose prefix (all values >= it) holds top_p of the (top-k-renormalised) mass:
        # the largest t with mass(s >= t) >= top_p * mass(K_top_k).
        weight = jnp.where(ordered >= threshold, jnp.exp(scaled - peak), 0.0)
        target = knobs.top_p * jnp.sum(weight, -1, keepdims=True)
        threshold = _largest_passing(
            threshold, top, lambda t: jnp.sum(jnp.where(ordered >= t, weight, 0.0), -1, keepdims=True) >= target
        )
    if use_min_p:
        # p_v >= min_p * max p  <=>  s_v >= max s + log(min_p)  (ratios do not change with renormalising).
        threshold = jnp.maximum(threshold, _ordered_bits(peak + jnp.log(knobs.min_p)))
    return threshold


def truncate_logits(scaled: jax.Array, knobs: Knobs, *, use_top_k: bool, use_top_p: bool,
                    use_min_p: bool) -> jax.Array:
    """`scaled [B, V]` with the tokens outside the kept set `K` (see `truncation_threshold`) at `-inf`."""
    threshold = truncation_threshold(scaled, knobs, use_top_k=use_top_k, use_top_p=use_top_p, use_min_p=use_min_p)
    return jnp.where(_ordered_bits(scaled) >= threshold, scaled, -jnp.inf)


def first_argmax(x: jax.Array) -> jax.Array:
    """`argmax(x, -1)` (first index on ties) as max + min-index: two plain reductions, which XLA on CPU runs
    several times faster than the variadic reduction of `jnp.argmax`."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == jnp.max(x, -1, keepdims=True), index, x.shape[-1]), -1)


def inverse_cdf_block(vocab: int) -> int:
    """The entries per block of `inverse_cdf_sample`'s two-level search: the power of two >= sqrt(V) (at least 8)."""
    return max(8, 1 << math.ceil(math.log2(math.sqrt(vocab))))


def inverse_cdf_sample(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Index `j` drawn with probability `w_j / sum(w)` from non-negative `weights [B, V]`, given
    `uniform [B]` in [0, 1): the first `j` with `cumsum(w)_j > u * sum(w)`, found in two levels
    (blocks of ~sqrt(V), then within the chosen block) so no [B, V] cumulative sum is built. Zero-weight
    entries are never returned (float rounding at a block edge cannot select one).
    """
    rows, vocab = weights.shape
    block = inverse_cdf_block(vocab)
    blocks = -(-vocab // block)
    w = jnp.pad(weights, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)

    def first_crossing(cumulative: jax.Array, u: jax.Array) -> jax.Array:
        # Count of entries <= u skips zero-weight entries before the crossing; the cap (entries below the
        # total) keeps a rounded-up u off the zero-weight entries after the last positive one.
        passed = jnp.sum(cumulative <= u[:, None], -1)
        return jnp.minimum(passed, jnp.sum(cumulative < cumulative[:, -1:], -1))

    block_mass = jnp.sum(w, -1)  # [B, blocks]
    block_cumulative = jnp.cumsum(block_mass, -1)
    u = uniform * block_cumulative[:, -1]
    chosen = first_crossing(block_cumulative, u)  # [B]
    before = jnp.take_along_axis(block_cumulative - block_mass, chosen[:, None], -1)[:, 0]
    inside = jnp.take_along_axis(w, chosen[:, None, None], 1)[:, 0]  # [B, block]
    offset = first_crossing(jnp.cumsum(inside, -1), jnp.maximum(u - before, 0.0))
    return (chosen * block + offset).astype(jnp.int32)


def sample_from_logits(logits: jax.Array, key: jax.Array, knobs: Knobs, *, greedy: bool, **truncation: bool
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row from `logits [B, V]`: `(token [B] int32, logprob [B], logprob_untruncated [B])`, each row
    drawn with a uniform of `key` (`truncation`: `sample_with_uniform`'s `use_top_k`, `use_top_p`, `use_min_p`).

    See the module docstring for the exact meaning of the two log-probs. All math in float32.
    """
    uniform = jax.random.uniform(key, logits.shape[:1], jnp.float32)
    return sample_with_uniform(logits, uniform, knobs, greedy=greedy, **truncation)


def sample_with_uniform(
    logits: jax.Array,
    uniform: jax.Array,
    knobs: Knobs,
    *,
    greedy: bool,
    use_top_k: bool = False,
    use_top_p: bool = False,
    use_min_p: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sample_from_logits` with each row's uniform draw `uniform [B]` in [0, 1) given (the rollout engine draws
    it from the row's own key and position, so a row's tokens do not depend on the batch it lands in)."""
    logits = logits.astype(jnp.float32)
    if greedy:
        token = first_argmax(logits)
        picked = jnp.take_along_axis(logits, token[:, None], -1)[:, 0]
        return token, jnp.zeros_like(picked), picked - jax.nn.logsumexp(logits, axis=-1)
    scaled = logits / knobs.temperature
    peak = jnp.max(scaled, -1, keepdims=True)
    weights = jnp.exp(scaled - peak)  # unnormalised softmax(s), the largest is 1
    truncating = use_top_k or use_top_p or use_min_p
    kept = weights
    if truncating:
        threshold = truncation_threshold(scaled, knobs, use_top_k=use_top_k, use_top_p=use_top_p,
                                         use_min_p=use_min_p)
        kept = jnp.where(_ordered_bits(scaled) >= threshold, weights, 0.0)
    token = inverse_cdf_sample(kept, uniform)
    picked = jnp.take_along_axis(scaled - peak, token[:, None], -1)[:, 0]
    untruncated = picked - jnp.log(jnp.sum(weights, -1))
    truncated = picked - jnp.log(jnp.sum(kept, -1)) if truncating else untruncated
    return token, truncated, untruncated
