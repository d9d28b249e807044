"""Context parallelism: one sequence's positions split over the mesh's `sequence` axis (`n` devices).

The training forward (the update, the log-prob passes) runs on activations `[B, T, D]` split on `T`: device `i`
holds positions `[i T/n, (i+1) T/n)` (`T_l = T / n` of them), so every per-position op (norms, projections, the
MLP, the LM head) is local. Attention is the one op that crosses positions; it runs inside a `shard_map` over the
mesh, in one of two ways (`sequence_attention`'s `method`, `ModelConfig.sequence_attention`):

- `gather`: each device all-gathers the keys, values and key segment ids of every position over
  `sequence` (`k, v [B, T, KVH, hd]`, linear in `T`) and attends its own `T_l` queries to them at
  `q_offset = i T_l` (`attention.xla_attention` with the mask as structure: causal, windows and segments read the
  slots, so segments that cross a shard boundary need nothing more). The backward reduce-scatters `dk, dv`.
- `ring` (the default): keys and values stay in blocks of `T_l`; `n` steps each attend the local queries to the
  block in hand and pass it to the next device (`ppermute`), merging blocks by an online softmax in float32

      m' = max(m, max_s x_s),  d' = d e^(m - m') + sum_s e^(x_s - m'),  o' = o e^(m - m') + sum_s e^(x_s - m') v_s,
      out = o / d                                                            (x: masked, scaled, capped scores)

  so no device holds more than two key blocks and its scores are `[B, H, chunk, T_l]` at a time (`query_chunk`
  queries, all `T_l` when 0); each step and chunk is under `jax.checkpoint` (scores are recomputed in the
  backward).

Measured on 8 virtual CPU devices (docs/scaling.md), `ring` needed less memory per device than `gather` (no
`[B, T, KVH, hd]` gathered keys; scores over `T_l` keys, not `T`) and ran faster at every `n`; `gather` is the
simpler program (one all-gather and one reduce-scatter per layer). Both give one device's attention up to float
reassociation (rows never mix; the mask reads global slots).
The sequence length must be a multiple of `n`: `pad_rows` pads a forward's inputs up to one (segment 0 / key mask 0
at the end of each row: no real query sees them) and the decoder slices its outputs back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models import precision
from jaxrl_llm.models.attention import AttentionMask, AttentionSpec, chunk_allowed, xla_attention
from jaxrl_llm.models.layers import head_sinks
from jaxrl_llm.models.options import SEQUENCE_METHODS
from jaxrl_llm.sharding import BATCH_AXES, SEQUENCE_AXIS, constrain, fit_spec

P = PartitionSpec
METHODS = SEQUENCE_METHODS
_NEG = -1e30  # a masked score: exp(_NEG - m) is 0 for any real m, and finite arithmetic where all are masked


def sequence_size(mesh: Mesh | None) -> int:
    """How many devices split one sequence (`mesh`'s `sequence` axis; 1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape.get(SEQUENCE_AXIS, 1))


def padded_length(length: int, mesh: Mesh | None) -> int:
    """`length` rounded up to a multiple of the mesh's `sequence` size."""
    n = sequence_size(mesh)
    return -(-length // n) * n


def pad_rows(x: jax.Array | None, length: int, axis: int = 1, value: int | float = 0) -> jax.Array | None:
    """`x` padded with `value` along `axis` to `length` (None stays None)."""
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def constrain_positions(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """`x [B, T, ...]` placed with rows over the batch axes and positions over `sequence` (a no-op without a
    mesh): the layout every activation of a sequence-parallel forward keeps."""
    return constrain(x, mesh, P(BATCH_AXES, SEQUENCE_AXIS))


def _head_axis(mesh: Mesh, heads: int, kv_heads: int) -> str | None:
    """`tensor` where it splits both the query and the key heads (each device's query heads then read only its own
    key heads), else None (heads whole inside the attention)."""
    t = int(mesh.shape.get("tensor", 1))
    return "tensor" if t > 1 and heads % t == 0 and kv_heads % t == 0 else None


def sequence_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, spec: AttentionSpec,
                       mesh: Mesh, *, sinks: jax.Array | None = None, query_chunk: int = 0,
                       compute_dtype: jnp.dtype | str = jnp.float32, method: str = "ring") -> jax.Array:
    """Self-attention `q [B, T, H, hd]`, `k, v [B, T, KVH, hd]` under `mask` (`q_segments, kv_segments [B, T]`, no
    offset: a training forward) and `spec`, with `T` split over `mesh`'s `sequence` axis -> `[B, T, H * hd]` split
    the same way (the module docstring: `gather` or `ring`). Rows stay split over the batch axes and heads over
    `tensor` where they divide; `sinks [H]` (gpt-oss) join every softmax. `T` must be a multiple of the axis size
    (`pad_rows`)."""
    if method not in METHODS:
        raise ValueError(f"sequence attention method must be one of {', '.join(METHODS)}, not {method!r}")
    if mask.q_offset is not None or k.shape[1] != q.shape[1]:
        raise ValueError("sequence_attention attends a sequence to itself (no cache, no query offset)")
    n = sequence_size(mesh)
    b, t, h, _ = q.shape
    if t % n:
        raise ValueError(f"a sequence of {t} positions does not split over mesh.sequence={n}; pad it to a multiple "
                         f"(sequence_parallel.pad_rows)")
    rows = fit_spec(P(BATCH_AXES), (b,), mesh)[0]
    heads = _head_axis(mesh, h, k.shape[2])
    act = P(rows, SEQUENCE_AXIS, heads, None)
    seg = P(rows, SEQUENCE_AXIS)
    body = functools.partial(_gather_shard if method == "gather" else _ring_shard, spec=spec, n=n,
                             query_chunk=query_chunk, compute_dtype=compute_dtype)
    args = (q, k, v, mask.q_segments.astype(jnp.int32), mask.kv_segments.astype(jnp.int32))
    specs = (act, act, act, seg, seg)
    if sinks is not None:
        args, specs = (*args, sinks), (*specs, P(heads))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(rows, SEQUENCE_AXIS, heads))(*args)


def _gather_shard(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
                  sinks: jax.Array | None = None, *, spec: AttentionSpec, n: int, query_chunk: int,
                  compute_dtype: jnp.dtype | str) -> jax.Array:
    """One device's share of `gather`: its `T_l` queries against every position's keys (all-gathered)."""
    local = q.shape[1]
    k, v, kv_seg = (jax.lax.all_gather(x, SEQUENCE_AXIS, axis=1, tiled=True) for x in (k, v, kv_seg))
    offset = (jax.lax.axis_index(SEQUENCE_AXIS) * local).astype(jnp.int32)
    return xla_attention(q, k, v, AttentionMask(q_seg, kv_seg, offset), spec, sinks=sinks, query_chunk=query_chunk,
                         compute_dtype=compute_dtype)


def _ring_shard(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array, kv_seg: jax.Array,
                sinks: jax.Array | None = None, *, spec: AttentionSpec, n: int, query_chunk: int,
                compute_dtype: jnp.dtype | str) -> jax.Array:
    """One device's share of `ring`: at step `j` it holds the key block of device `(i - j) mod n` (blocks move to
    the next device each step) and folds it into the online softmax of its queries (module docstring)."""
    b, local, h, hd = q.shape
    kvh = k.shape[2]
    g = h // kvh
    scale = hd ** -0.5 if spec.scale is None else spec.scale
    me = jax.lax.axis_index(SEQUENCE_AXIS)
    q_offset = (me * local).astype(jnp.int32)
    grouped = q.reshape(b, local, kvh, g, hd)
    perm = [(i, (i + 1) % n) for i in range(n)]

    def fold_part(carry: tuple[jax.Array, ...], q_part: jax.Array, start: jax.Array | int,
                  block: tuple[jax.Array, ...], source: jax.Array) -> tuple[jax.Array, ...]:
        """Queries `start ...` (`q_part [B, c, KVH, G, hd]`, their state `(m, den [B, KVH, G, c], o [B, KVH, G, c,
        hd])`) after key block `source`."""
        m, den, o = carry
        kb, vb, sb = block
        # Slots of this block: `source * T_l + s`; the queries' are `q_offset + t` (what `chunk_allowed` reads).
        allowed = chunk_allowed(AttentionMask(q_seg, sb, q_offset - source * local), spec, start, q_part.shape[1],
                                local)[:, None, None]
        scores = precision.einsum("btkgd,bskd->bkgts", q_part, kb, compute_dtype, jnp.float32) * scale
        if spec.softcap is not None:
            scores = spec.softcap * jnp.tanh(scores / spec.softcap)
        scores = jnp.where(allowed, scores, _NEG)
        # The running max only keeps exp() in range; the result does not depend on it, so no gradient flows there.
        m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(scores, axis=-1)))
        p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
        decay = jnp.exp(m - m_new)
        den_new = den * decay + jnp.sum(p, axis=-1)
        o_new = o * decay[..., None] + precision.einsum("bkgts,bskd->bkgtd", p, vb, compute_dtype, jnp.float32)
        return m_new, den_new, o_new

    chunk = query_chunk if 0 < query_chunk < local else local
    n_full, rem = divmod(local, chunk)
    full = n_full * chunk

    def fold(carry: tuple[jax.Array, ...], block: tuple[jax.Array, ...], source: jax.Array
             ) -> tuple[jax.Array, ...]:
        """The online-softmax state `(m, den [B, KVH, G, T_l], o [B, KVH, G, T_l, hd])` after key block `source`,
        `chunk` queries at a time (scores `[B, H, chunk, T_l]`, each chunk's recomputed in the backward)."""
        if n_full == 1 and not rem:
            return fold_part(carry, grouped, 0, block, source)

        def split(x: jax.Array) -> jax.Array:  # [B, KVH, G, full, ...] -> [n_full, B, KVH, G, chunk, ...]
            return jnp.moveaxis(x[:, :, :, :full].reshape(*x.shape[:3], n_full, chunk, *x.shape[4:]), 3, 0)

        def merge(x: jax.Array) -> jax.Array:
            return jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], full, *x.shape[5:])

        parts = jnp.moveaxis(grouped[:, :full].reshape(b, n_full, chunk, kvh, g, hd), 1, 0)
        starts = jnp.arange(n_full, dtype=jnp.int32) * chunk
        out = jax.lax.map(jax.checkpoint(lambda xs: fold_part(xs[:3], xs[3], xs[4], block, source)),
                          (*(split(x) for x in carry), parts, starts))
        out = tuple(merge(x) for x in out)
        if not rem:
            return out
        tail = fold_part(tuple(x[:, :, :, full:] for x in carry), grouped[:, full:], full, block, source)
        return tuple(jnp.concatenate([a, t], axis=3) for a, t in zip(out, tail, strict=True))

    folded = jax.checkpoint(fold)  # a step's scores are recomputed in the backward, not kept for all n steps

    def step(state: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]], j: jax.Array
             ) -> tuple[tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]], None]:
        carry, block = state
        block = tuple(jax.lax.ppermute(x, SEQUENCE_AXIS, perm) for x in block)
        return (folded(carry, block, (me - j) % n), block), None

    m0 = jnp.full((b, kvh, g, local), _NEG, jnp.float32)
    init = (m0, jnp.zeros_like(m0), jnp.zeros((b, kvh, g, local, hd), jnp.float32))
    own = (k, v, kv_seg)
    ((m, den, o), _), _ = jax.lax.scan(step, (folded(init, own, me), own), jnp.arange(1, n))
    grouped_sinks = head_sinks(sinks, kvh)  # [KVH, G, 1]: a logit in the denominator only
    if grouped_sinks is not None:
        sink = grouped_sinks.astype(jnp.float32)[None]  # [1, KVH, G, 1]
        top = jax.lax.stop_gradient(jnp.maximum(m, sink))
        den = den * jnp.exp(m - top) + jnp.exp(sink - top)
        o = o * jnp.exp(m - top)[..., None]
    out = o / jnp.where(den > 0, den, 1.0)[..., None]  # a query that sees nothing (padding) gets 0
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, local, h * hd)
    return out.astype(precision.activation_dtype(jnp.dtype(compute_dtype)))
