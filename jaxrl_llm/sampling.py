"""Jitted sampler: one prefill of a left-padded prompt batch, then a `lax.while_loop` decode on a KV cache.

`sample(params, model_config, prompt_tokens, prompt_mask, key, sampling)` is the one entry point.

Program shape (one XLA program per prompt bucket, completion bucket, batch size and static switch set):

1. Prefill: the prompt batch `[B, P_b]` (left-padded, `P_b` = longest prompt rounded up to a multiple of
   `prompt_bucket`) runs once through the decoder, filling per-layer caches `[B, P_b, KVH, hd]`; only the
   last position is unembedded (`logits [B, V]`): the `[B, P_b, V]` prompt logits are never built.
2. `n` samples per prompt: the prompt's caches and last logits are repeated `n` times along the batch
   (`jnp.repeat`, prompt-major rows), so the prompt is computed once, not `n` times, and padded with the
   empty completion slots (`T_b` = `max_new_tokens` rounded up to a multiple of `new_tokens_bucket`), and
   transposed once to the decode loop's layout (`loop_caches`): keys `[B*n, KVH, hd, P_b + T_b]`, values
   `[B*n, KVH, P_b + T_b, hd]`.
3. Decode: `lax.while_loop` over new tokens, one `T = 1` decoder step per iteration, until every row has
   emitted one of `eos_ids` or `max_new_tokens` tokens were made. The loop bound and the sampling knobs
   (temperature, top-k, top-p, min-p values, `max_new_tokens`) are traced values, so every call whose
   lengths fall into one bucket reuses one compiled program; only *whether* greedy / top-k / top-p / min-p
   is on, `n`, `eos_ids` and `pad_id` are static (they change the program).

The decoder's layers run unrolled over per-layer weights and caches: `decode_layers` (the same Flax modules
as `Decoder`) for the prefill, and `decode_token` (the same math in plain `jnp`, q|k|v and gate|up fused,
caches laid out as the attention contractions read them, so XLA does not transpose the caches on every
step) in the loop: inside a while loop,
`nn.scan` over the stacked `[L, ...]` arrays would copy every layer's weights and cache slice out and the
updated cache back on every token.

KV-cache memory: allocated once per call, inside the jitted program, as one key and one value buffer per
layer, `[B*n, KVH, hd, P_b + T_b]` and `[B*n, KVH, P_b + T_b, hd]` (together as large as the
`[L, B*n, P_b + T_b, KVH, hd]` cache of `init_cache`), in the model's compute dtype:

    cache_bytes = 2 * L * (B * n) * (P_b + T_b) * KVH * hd * itemsize(dtype)

(e.g. Qwen2.5-0.5B, L=24, KVH=2, hd=64, bf16, B*n=64, P_b + T_b = 1024: 2*24*64*1024*2*64*2 B = 805 MB).
The prefill caches (`B` rows, `P_b` slots) live only until they are broadcast. The cache never crosses the
jit boundary: it is created, updated and dropped inside the one program, carried by `lax.while_loop` as
loop-carried buffers that XLA updates in place (a token step writes one slot, `B*n * KVH * hd` values, per
layer and buffer). That is what donating a cache passed in from outside would achieve, with nothing for the caller
to manage; no copy of the cache is made per step. The per-layer weights (`StepWeights`: one copy of the
layer weights, q|k|v and gate|up concatenated) are also made once per call, outside the loop.

Sampling semantics of one step, from the float32 logits `z [B*n, V]` of the next token:
- greedy: `token = argmax(z)` (first index on ties, as torch). The sampled distribution is a point mass, so
  `logprobs = 0`; `logprobs_untruncated = log_softmax(z)[token]` (temperature 1).
- otherwise `s = z / temperature`, then truncation in transformers' order (top-k, then top-p, then min-p),
  each keeping a set `K` of tokens (ties at a threshold are all kept, so `K` may exceed `top_k` on ties):
  - top-k: keep `s_v >= s_(k)` (the k-th largest);
  - top-p: in descending order of the top-k-renormalised probabilities `p_(1) >= p_(2) >= ...`, keep the
    smallest prefix whose mass reaches `top_p`: rank `j` is kept iff `sum_{i<j} p_(i) < top_p`;
  - min-p: keep `p_v >= min_p * max_v p_v`, i.e. `s_v >= max(s) + log(min_p)`.
  The token is drawn from `q = softmax(s restricted to K)` by inverse CDF with one uniform per row, and
  - `logprobs = log q(token) = s_token - logsumexp_{v in K} s_v`: the log-prob under the distribution
    actually sampled from (the behaviour policy of the rollout, truncation included);
  - `logprobs_untruncated = log_softmax(s)[token] = s_token - logsumexp_v s_v`: the full-vocabulary
    log-prob at the same temperature: what a trainer's recomputation `log_softmax(logits / T)[token]` over
    prompt + completion gives for the same parameters (tested to 1e-4), hence the consistent old-policy
    log-prob for an importance ratio against such a recomputation. Without truncation the two are equal.
  Both are 0 on masked (post-EOS / beyond-length) positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import (
    StepWeights,
    constrain_step_weights,
    decode_token,
    fusable_shards,
    longrope_original,
    longrope_switch,
    loop_caches,
    prefill,
    split_layers,
    step_weights,
)
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.layers import positions_from_mask
from jaxrl_llm.sharding import BATCH_AXES, constrain, global_array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample completions.

    - `max_new_tokens`: completion length limit `T` (the returned arrays have exactly `T` columns).
    - `temperature`, `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off): see the module docstring.
    - `greedy`: argmax decoding; temperature and truncation are then ignored.
    - `n`: samples per prompt, all sharing one prefill; output rows `i*n ... i*n+n-1` belong to prompt `i`.
    - `eos_ids`: a row stops after emitting any of these ids (the EOS is part of the completion, mask 1).
    - `pad_id`: fills completion slots after the stop.
    - `prompt_bucket`, `new_tokens_bucket`: the prompt length (longest row, after dropping all-padding
      columns) and `max_new_tokens` are rounded up to a multiple of these, and one program is compiled per
      rounded pair: e.g. with 64, any prompt of 1..64 tokens and any `max_new_tokens` of 1..64 share one
      program. 1 means exact lengths (a compile per distinct length).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    n: int = 1
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 64
    new_tokens_bucket: int = 64

    def __post_init__(self) -> None:
        # Accept any iterable (a list from YAML, a single int) and store a hashable tuple.
        eos = (self.eos_ids,) if isinstance(self.eos_ids, int) else tuple(int(e) for e in self.eos_ids)
        object.__setattr__(self, "eos_ids", eos)
        errors = []
        if self.max_new_tokens < 1:
            errors.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            errors.append(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            errors.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.n < 1:
            errors.append(f"n must be >= 1, got {self.n}")
        if self.prompt_bucket < 1 or self.new_tokens_bucket < 1:
            errors.append(f"buckets must be >= 1, got {self.prompt_bucket}, {self.new_tokens_bucket}")
        if errors:
            raise ValueError("invalid SamplingConfig: " + "; ".join(errors))

    @property
    def uses_top_k(self) -> bool:
        return not self.greedy and self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return not self.greedy and self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return not self.greedy and self.min_p > 0.0


class SampleOutput(NamedTuple):
    """Completions, row `i*n + j` = sample `j` of prompt `i` (reshape to `[B, n, ...]` recovers groups).

    - `tokens [B*n, T]` int32: completion ids, right-padded with `pad_id` after the first EOS.
    - `mask [B*n, T]` int32: 1 up to and including the first EOS (or all `T` without one), else 0.
    - `logprobs [B*n, T]` float32: log-prob of each token under the distribution it was sampled from (after
      temperature and top-k/top-p/min-p truncation, renormalised); 0 in greedy mode and on masked slots.
    - `logprobs_untruncated [B*n, T]` float32: `log_softmax(logits / temperature)[token]` over the full
      vocabulary (temperature 1 in greedy mode): what a trainer recomputing `log_softmax(logits / T)` gets.
    - `lengths [B*n]` int32: number of completion tokens (`mask.sum(-1)`).
    - `stopped_on_eos [B*n]` bool: the row ended with an EOS id (False: it hit `max_new_tokens`).
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    lengths: jax.Array
    stopped_on_eos: jax.Array


class _Static(NamedTuple):
    """The part of a `SamplingConfig` that shapes the compiled program (hashable, a static jit argument)."""

    new_tokens: int  # T_b, the bucketed completion length
    greedy: bool
    top_k: bool
    top_p: bool
    min_p: bool
    n: int
    eos_ids: tuple[int, ...]
    pad_id: int


class Knobs(NamedTuple):
    """Traced sampling values (changing them never recompiles). Scalars; `top_k` is int32, the rest float32
    except `max_new_tokens` (int32)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    max_new_tokens: jax.Array


def knobs_from_config(sampling: SamplingConfig) -> Knobs:
    # Explicit dtypes: a Python int temperature must not trace differently from a float one.
    return Knobs(
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(sampling.top_k),
        top_p=np.float32(sampling.top_p),
        min_p=np.float32(sampling.min_p),
        max_new_tokens=np.int32(sampling.max_new_tokens),
    )


def bucket_length(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket` (at least one bucket)."""
    return max(1, math.ceil(length / bucket)) * bucket


# ------------------------------------------------------------------------------------- one sampling step
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


def inverse_cdf_sample(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Index `j` drawn with probability `w_j / sum(w)` from non-negative `weights [B, V]`, given
    `uniform [B]` in [0, 1): the first `j` with `cumsum(w)_j > u * sum(w)`, found in two levels
    (blocks of ~sqrt(V), then within the chosen block) so no [B, V] cumulative sum is built. Zero-weight
    entries are never returned (float rounding at a block edge cannot select one).
    """
    rows, vocab = weights.shape
    block = max(8, 1 << math.ceil(math.log2(math.sqrt(vocab))))
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


def sample_from_logits(
    logits: jax.Array,
    key: jax.Array,
    knobs: Knobs,
    *,
    greedy: bool,
    use_top_k: bool = False,
    use_top_p: bool = False,
    use_min_p: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row from `logits [B, V]`: `(token [B] int32, logprob [B], logprob_untruncated [B])`.

    See the module docstring for the exact meaning of the two log-probs. All math in float32.
    """
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
    token = inverse_cdf_sample(kept, jax.random.uniform(key, logits.shape[:1], jnp.float32))
    picked = jnp.take_along_axis(scaled - peak, token[:, None], -1)[:, 0]
    untruncated = picked - jnp.log(jnp.sum(weights, -1))
    truncated = picked - jnp.log(jnp.sum(kept, -1)) if truncating else untruncated
    return token, truncated, untruncated


# --------------------------------------------------------------------------------------- the program


def _completion_caches(prompt_caches: list[dict[str, jax.Array]], n: int, new_tokens: int,
                       mesh: Mesh | None) -> list[dict[str, jax.Array]]:
    """The prompts' caches broadcast to `n` samples each (prompt-major rows), in the decode loop's
    `loop_caches` layout (transposed here once per call, not by XLA inside every step), with `new_tokens`
    empty completion slots appended on the slot axis."""
    def extend(a: jax.Array, slot_axis: int) -> jax.Array:
        slots = [(0, new_tokens if axis == slot_axis else 0) for axis in range(a.ndim)]
        return constrain(jnp.pad(jnp.repeat(a, n, axis=0), slots), mesh, PartitionSpec(BATCH_AXES, "tensor"))

    return [{"k": extend(c["k"], 3), "v": extend(c["v"], 2)} for c in loop_caches(prompt_caches)]


def _emit(i: jax.Array | int, logits: jax.Array, done: jax.Array, length: jax.Array, outputs: tuple[jax.Array, ...],
          *, key: jax.Array, knobs: Knobs, static: _Static) -> tuple[jax.Array, jax.Array, jax.Array, tuple]:
    """Sample completion token `i` for every row from `logits [R, V]` into column `i` of `outputs` (tokens,
    log-probs, untruncated log-probs); rows already done get padding. Returns `(token, done, length, outputs)`."""
    token, logprob, untruncated = sample_from_logits(
        logits,
        jax.random.fold_in(key, i),
        knobs,
        greedy=static.greedy,
        use_top_k=static.top_k,
        use_top_p=static.top_p,
        use_min_p=static.min_p,
    )
    active = ~done
    token = jnp.where(active, token, static.pad_id)
    columns = (token, jnp.where(active, logprob, 0.0), jnp.where(active, untruncated, 0.0))
    outputs = tuple(
        jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), i, axis=1)
        for buf, col in zip(outputs, columns, strict=True)
    )
    eos_ids = jnp.asarray(static.eos_ids, jnp.int32)
    hit_eos = jnp.any(token[:, None] == eos_ids, axis=-1) if static.eos_ids else jnp.zeros_like(done)
    return token, done | (active & hit_eos), length + active.astype(jnp.int32), outputs


def _decode_loop(step: Callable[..., tuple[jax.Array, Any]], emit: Callable[..., tuple], max_new: jax.Array,
                 state: tuple) -> tuple[jax.Array, jax.Array, tuple]:
    """`lax.while_loop` over tokens `i = 1, 2, ...` while `i < max_new` and some row is not done: `step` feeds
    token `i - 1` and gives the logits of token `i`, `emit` samples it. `state = (i, token, caches, done, length,
    outputs)`; returns the final `(done, length, outputs)`."""
    def keep_going(state: tuple) -> jax.Array:
        i, _, _, done, _, _ = state
        return (i < max_new) & ~jnp.all(done)

    def body(state: tuple) -> tuple:
        i, token, caches, done, length, outputs = state
        logits, caches = step(i, token, caches)
        token, done, length, outputs = emit(i, logits, done, length, outputs)
        return i + 1, token, caches, done, length, outputs

    _, _, _, done, length, outputs = jax.lax.while_loop(keep_going, body, state)
    return done, length, outputs


def _completion_key_mask(prompt_mask: jax.Array, n: int, new_tokens: int) -> tuple[jax.Array, jax.Array]:
    """The decode loop's key mask `[B * n, P_b + T_b]` (each prompt's mask, then every completion slot valid)
    and the position of completion token 0 of each row `[B * n]` (its prompt's length)."""
    rows = prompt_mask.shape[0] * n
    # Completion slots are all marked valid up front: causality (key slot <= query slot) already hides the
    # slots not written yet, so the key mask never changes inside the loop.
    key_mask = jnp.concatenate(
        [jnp.repeat(prompt_mask, n, axis=0), jnp.ones((rows, new_tokens), prompt_mask.dtype)], axis=1
    )
    return key_mask, jnp.repeat(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32), n)


def _empty_outputs(rows: int, new_tokens: int, pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loop's outputs before the first token: tokens (all `pad_id`), log-probs, untruncated log-probs,
    each `[rows, new_tokens]`."""
    return (
        jnp.full((rows, new_tokens), pad_id, jnp.int32),
        jnp.zeros((rows, new_tokens), jnp.float32),
        jnp.zeros((rows, new_tokens), jnp.float32),
    )


def _token_step(params: Params, weights: list[StepWeights], config: ModelConfig, key_mask: jax.Array,
                first_position: jax.Array, prompt_len: int,
                shards: int) -> Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any]]:
    """The loop body's model call `step(i, token, caches) -> (logits, caches)`: feed token `i - 1` (cache slot
    `P_b + i - 1`) and get the logits of token `i`; a longrope model switches to its long factors on the step
    the batch's longest row first reaches past the original context."""
    original = longrope_original(config)
    key_positions = positions_from_mask(key_mask) if original is not None else None

    def step(i: jax.Array, token: jax.Array, caches: Any) -> tuple[jax.Array, Any]:
        slot = prompt_len + i - 1
        if original is not None:  # the batch's longest row reaches past longrope's original context now
            reach = jnp.max(first_position) + i  # transformers' seq_len of this call; the previous one was 1 less
            caches = jax.lax.cond((reach > original) & (reach - 1 <= original),
                                  lambda c: longrope_switch(c, config, key_positions), lambda c: c, caches)
        return decode_token(params, weights, config, token, first_position + i - 1, key_mask, caches, slot, shards)

    return step


@functools.partial(jax.jit, static_argnames=("config", "static", "mesh"))
def _sample_program(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    knobs: Knobs,
    *,
    config: ModelConfig,
    static: _Static,
    mesh: Mesh | None = None,
) -> SampleOutput:
    """Prefill + while-loop decode on bucketed inputs; outputs have `T_b = static.new_tokens` columns.

    On a `mesh`, rows are split over `("data", "fsdp")` and the caches' KV heads over `tensor`; the
    per-layer token-step weights are gathered over `fsdp` once per call (kept split over `tensor`), not
    on every token.
    """
    n, new_tokens = static.n, static.new_tokens
    prompt_len = prompt_tokens.shape[1]
    rows_spec = PartitionSpec(BATCH_AXES)
    prompt_tokens, prompt_mask = constrain(prompt_tokens, mesh, rows_spec), constrain(prompt_mask, mesh, rows_spec)
    layer_params = split_layers(params, config)
    shards = fusable_shards(config, mesh.shape["tensor"]) if mesh is not None else 1
    weights = [constrain_step_weights(w, mesh) for w in step_weights(layer_params, config, shards)]

    # Prefill the B prompts once; the n samples of a prompt share it.
    logits, prompt_caches = prefill(params, layer_params, config, prompt_tokens, prompt_mask)

    logits = jnp.repeat(logits, n, axis=0)
    caches = _completion_caches(prompt_caches, n, new_tokens, mesh)
    rows = logits.shape[0]
    key_mask, first_position = _completion_key_mask(prompt_mask, n, new_tokens)
    emit = functools.partial(_emit, key=key, knobs=knobs, static=static)
    outputs = _empty_outputs(rows, new_tokens, static.pad_id)
    token, done, length, outputs = emit(0, logits, jnp.zeros((rows,), bool), jnp.zeros((rows,), jnp.int32), outputs)
    max_new = jnp.minimum(knobs.max_new_tokens, new_tokens)
    step = _token_step(params, weights, config, key_mask, first_position, prompt_len, shards)
    done, length, outputs = _decode_loop(step, emit, max_new, (jnp.int32(1), token, caches, done, length, outputs))
    tokens, logprobs, untruncated = outputs
    mask = (jnp.arange(new_tokens)[None, :] < length[:, None]).astype(jnp.int32)
    out = SampleOutput(tokens, mask, logprobs, untruncated, length, done)
    return jax.tree.map(lambda x: constrain(x, mesh, rows_spec), out)


def bucket_prompts(
    prompt_tokens: Any, prompt_mask: Any, sampling: SamplingConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded `[B, P]` prompts -> `[B, P_b]` int32 numpy, `P_b = bucket_length(longest row)`.

    All-padding leading columns are dropped first, then padding (`pad_id`, mask 0) is added on the left;
    every masked slot holds `pad_id`.
    Raises `ValueError` unless every row is left-padded (mask `0...0 1...1`) with at least one token.
    """
    tokens = np.asarray(prompt_tokens, dtype=np.int32)
    mask = np.asarray(prompt_mask, dtype=np.int32)
    if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(f"prompt_tokens {tokens.shape} and prompt_mask {mask.shape} must both be [B, P]")
    lengths = mask.sum(axis=1)
    if ((mask != 0) & (mask != 1)).any() or (np.diff(mask, axis=1) < 0).any():
        raise ValueError("prompts must be left-padded: each prompt_mask row must be 0...0 1...1")
    if (lengths < 1).any():
        raise ValueError(f"every prompt needs at least one token; empty rows: {np.flatnonzero(lengths < 1)}")
    longest = int(lengths.max())
    padded_len = bucket_length(longest, sampling.prompt_bucket)
    out_tokens = np.full((tokens.shape[0], padded_len), sampling.pad_id, np.int32)
    out_mask = np.zeros((tokens.shape[0], padded_len), np.int32)
    out_tokens[:, padded_len - longest :] = np.where(mask, tokens, sampling.pad_id)[:, tokens.shape[1] - longest :]
    out_mask[:, padded_len - longest :] = mask[:, mask.shape[1] - longest :]
    return out_tokens, out_mask


def _static_from_config(sampling: SamplingConfig) -> _Static:
    """The switches of `sampling` that change the program (one compiled program per distinct set)."""
    s = sampling
    return _Static(new_tokens=bucket_length(s.max_new_tokens, s.new_tokens_bucket), greedy=s.greedy,
                   top_k=s.uses_top_k, top_p=s.uses_top_p, min_p=s.uses_min_p, n=s.n, eos_ids=s.eos_ids,
                   pad_id=s.pad_id)


def _program_args(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    tokens, mask = bucket_prompts(prompt_tokens, prompt_mask, sampling)
    if mesh is not None:
        # Every process holds the same host prompts; each device receives only its rows.
        tokens, mask = global_array(tokens, mesh, PartitionSpec(BATCH_AXES)), global_array(
            mask, mesh, PartitionSpec(BATCH_AXES))
    args = (params, tokens, mask, key, knobs_from_config(sampling))
    return args, {"config": model_config, "static": _static_from_config(sampling), "mesh": mesh}


def sample(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> SampleOutput:
    """Sample `sampling.n` completions for each prompt of a left-padded batch.

    `prompt_tokens, prompt_mask [B, P]` (numpy or jax; mask 1 = token, rows left-padded). `key` is a
    `jax.random.key`: the same key gives the same tokens, so a trainer folds a fresh one per step. Returns a
    `SampleOutput` with `B * n` prompt-major rows and exactly `sampling.max_new_tokens` columns.
    With a `mesh` (and `params` placed by `jaxrl_llm.sharding`), the batch is split over its `data` and
    `fsdp` axes and the KV cache's heads over `tensor`; the tokens are the same as on one device.
    """
    args, static = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
    return _trim(_sample_program(*args, **static), sampling.max_new_tokens)


def _trim(out: SampleOutput, columns: int) -> SampleOutput:
    """Drop the completion bucket's excess columns (beyond `max_new_tokens`)."""
    if out.tokens.shape[1] == columns:
        return out
    return out._replace(
        tokens=out.tokens[:, :columns],
        mask=out.mask[:, :columns],
        logprobs=out.logprobs[:, :columns],
        logprobs_untruncated=out.logprobs_untruncated[:, :columns],
    )


def compile_sampler(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> Callable[[Params, Any, Any, jax.Array], SampleOutput]:
    """Compile (ahead of time, without running) the program `sample` would use for these inputs.

    Returns `run(params, prompt_tokens, prompt_mask, key) -> SampleOutput`, which executes that compiled
    program for any inputs of the same buckets and `sampling`, so callers can time compilation apart from
    generation (the CLI and the benchmark do).
    """
    args, static = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
    compiled = _sample_program.lower(*args, **static).compile()

    def run(params: Params, prompt_tokens: Any, prompt_mask: Any, key: jax.Array) -> SampleOutput:
        args, _ = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
        return _trim(compiled(*args), sampling.max_new_tokens)

    return run


def compiled_program_count() -> int:
    """Number of sampler programs compiled in this process (one per bucket and static switch set)."""
    return _sample_program._cache_size()
