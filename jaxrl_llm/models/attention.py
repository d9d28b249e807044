"""Training attention behind one seam, with the mask given as what it is (DESIGN 13, 14).

    out[b, t, h] = softmax_s(mask(softcap(scale * q[b, t, h] . k[b, s, h // G]))) . v[b, s, h // G]

`q [B, T, H, hd]`, `k, v [B, S, KVH, hd]`, `G = H / KVH` query heads per key head, `out [B, T, H * hd]`. Query `t`
sits in slot `q_offset + t` (or its own `q_slots[b, t]`: the engine's prefill chunks); key `s` in slot `s`. The mask
is never an array of its own: query `t` may attend to key `s` when

    q_segments[b, t] == kv_segments[b, s] > 0                         (same sequence, not padding)
    and s <= q_offset + t                                             (`causal`)
    and q_offset + t - s < W                                          (a sliding window `W`)

(`AttentionMask`). A packed row is several segments `1, 2, ...` then 0s (`q_segments = kv_segments`); a left-padded
row, or a cache, is `kv_segments = key_mask` with every query in segment 1 (`AttentionMask.padded`). The tests hold
every path to a dense attention under the dense `[B, T, S]` masks this replaces (tests/attention_reference.py).
`sinks [H]` (gpt-oss) add one logit per head to each softmax's denominator (`layers.masked_softmax`).

Backends (`attention_backend` picks one per layer kind):
- `xla`: the reference, everywhere: `layers.attention_block`'s math (float32 scores and softmax, the dots
  `precision.einsum`s in the compute dtype, GQA by grouping the queries, no repeated keys), chunked over queries,
  each chunk's `[B, chunk, S]` mask built from the segment ids and slots inside the chunk: no `[B, T, S]` array
  exists forward or backward once `T > query_chunk`. Causal self-attention longer than `UNROLLED_LENGTH` runs
  `blocked_attention`: flash attention in XLA (blocks of queries against blocks of keys, the pairs the mask forbids
  skipped, an online softmax, its own backward), memory linear in `T`.
- `pallas_gpu`: `jax.experimental.pallas.ops.gpu.attention.mha` (Triton flash attention, segment ids, causal, its
  own backward kernels). It indexes key heads by query head, so GQA keys are repeated `G` times (`[B, S, H, hd]`,
  linear in `S`). `pallas_interpret`: the same kernel in Pallas' interpreter (any device; what the tests run).
- `pallas_tpu`: splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`: segment ids, causal and local
  masks, GQA without repeated keys, soft cap, sinks), head sizes that are multiples of 128 (Mosaic's lanes).
  `pallas_tpu_interpret`: the same kernel in Pallas' interpreter.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (causal, sliding window, GQA), which takes no
  segment ids, only per-row lengths of a valid prefix: it covers `layout="prefix"` masks (one segment a row, its
  tokens first) in bfloat16/float16. cuDNN is probed at trace time, so it lowers only on a machine with cuDNN.

The kernels take one segment-id array for queries and keys (self-attention, `S = T`, no `q_offset`): they read
`kv_segments` as the queries' too. They agree with `xla` at every query whose segment is its own slot's key's (every
real token); a padding query's output (which no real query reads) differs between backends. Whatever a kernel cannot
express (a window or soft cap or sinks for `mha`, queries into a cache, head sizes) runs on `xla`, and
`attention_backend` says why.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from jaxrl_llm.models import precision
from jaxrl_llm.models.layers import MASKED, attention_block, softcap
from jaxrl_llm.models.options import ATTENTION_BACKENDS, ATTENTION_REQUESTS

BACKENDS = ATTENTION_BACKENDS
REQUESTS = ATTENTION_REQUESTS
LAYOUTS = ("segments", "prefix")
# What a header names each backend.
NAMES = {"xla": "XLA (chunked)", "pallas_gpu": "Pallas GPU flash (segment ids)",
         "pallas_tpu": "Pallas TPU splash (segment ids)", "cudnn": "cuDNN flash (prefix lengths)",
         "pallas_interpret": "Pallas GPU flash, interpreted (segment ids)",
         "pallas_tpu_interpret": "Pallas TPU splash, interpreted (segment ids)"}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# Chunked causal self-attention of at most this many queries unrolls its chunks with static key extents; longer runs
# `blocked_attention` (memory linear in the context). `xla_attention` has the measurements behind it.
UNROLLED_LENGTH = 512


class AttentionMask(NamedTuple):
    """The mask as structure: `q_segments [B, T]`, `kv_segments [B, S]` int32 (0 = padding; a query attends to the
    keys of its own segment), and `q_offset`: the slot of query 0, a scalar int32 array (a cache's index), or None
(training: slot 0, known while tracing, so causal chunks read only the keys up to their last query; None stays None
through `jit`, where a Python 0 would be traced). Causality and windows are static arguments of `attention`."""

    q_segments: jax.Array
    kv_segments: jax.Array
    q_offset: jax.Array | None = None
    # Each query's own slot `[B, T]` int32, in place of `q_offset + t` (the engine's prefill: rows at their own
    # positions into their gathered pages); None: `q_offset + t`.
    q_slots: jax.Array | None = None

    @classmethod
    def packed(cls, segments: jax.Array) -> AttentionMask:
        """Packed rows `segments [B, T]` (sequence `k > 0` or 0 on padding): queries and keys alike."""
        segments = segments.astype(jnp.int32)
        return cls(segments, segments, None)

    @classmethod
    def padded(cls, key_mask: jax.Array, num_queries: int, q_offset: jax.Array | int | None = None
               ) -> AttentionMask:
        """Left-padded rows or a cache: `key_mask [B, S]` (1 = a valid key slot), `num_queries` queries at slots
        `q_offset ...` (None: 0, static; an int becomes an int32 array), all in segment 1 (a padding query then
        sees the valid keys before it, as a cache's dense mask lets it)."""
        kv = key_mask.astype(bool).astype(jnp.int32)
        offset = None if q_offset is None else jnp.asarray(q_offset, jnp.int32)
        return cls(jnp.ones((kv.shape[0], num_queries), jnp.int32), kv, offset)

    @classmethod
    def at_positions(cls, positions: jax.Array, keys: int) -> AttentionMask:
        """Queries at their own slots `positions [B, T]` (-1: a padding query, which attends to nothing) against
        `keys` key slots of one sequence per row (slot = position: a row's gathered context), every key valid
        (causality keeps a query from the slots after its own, written or not)."""
        positions = positions.astype(jnp.int32)
        return cls((positions >= 0).astype(jnp.int32), jnp.ones((positions.shape[0], keys), jnp.int32), None,
                   positions)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static part of one attention: `causal` (`s <= q_offset + t`), a sliding `window` `W`
    (`q_offset + t - s < W`, with `causal`), a logit `softcap` (`cap * tanh(x / cap)` after the scale), `scale`
    (None: `hd ** -0.5`), and `layout`: `segments` (any segment ids) or `prefix` (each row one segment, its valid
    tokens first: what cuDNN's lengths express)."""

    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    layout: str = "segments"


@dataclasses.dataclass(frozen=True)
class Features:
    """What `attention_backend` decides on: the spec, the head size, the compute dtype's name, whether there are
    sinks, and whether the queries sit at an offset into keys that are not themselves (a cache: a `q_offset`, or
    `S != T`)."""

    spec: AttentionSpec
    head_dim: int
    dtype: str = "float32"
    sinks: bool = False
    cache: bool = False


def features_of(spec: AttentionSpec, q: jax.Array, k: jax.Array, mask: AttentionMask,
                sinks: jax.Array | None = None, compute_dtype: jnp.dtype | str = jnp.float32) -> Features:
    """`Features` of a call `attention(q [B, T, H, hd], k [B, S, KVH, hd], mask, spec, sinks)`."""
    cache = mask.q_offset is not None or mask.q_slots is not None or k.shape[1] != q.shape[1]
    return Features(spec, q.shape[-1], jnp.dtype(compute_dtype).name, sinks is not None, cache)


def kernel_unsupported(backend: str, features: Features) -> str | None:
    """Why `backend` cannot run an attention with `features` (one clause, naming the kernel), or None."""
    spec = features.spec
    base = backend.removesuffix("_interpret") if backend != "pallas_interpret" else "pallas_gpu"
    if base == "xla":
        return None
    if features.cache:
        return f"{base} attends only a sequence to itself (no queries into a cache)"
    if spec.window is not None and not spec.causal:
        return f"{base}: a window without causality"
    if base == "pallas_gpu":
        for what, present in (("sliding window", spec.window is not None), ("soft cap", spec.softcap is not None),
                              ("attention sinks", features.sinks)):
            if present:
                return f"pallas_gpu has no {what}"
        return None
    if base == "pallas_tpu":
        if features.head_dim % 128:
            return f"pallas_tpu needs a head size that is a multiple of 128 (this one is {features.head_dim})"
        return None
    if base == "cudnn":
        if spec.layout != "prefix":
            return "cudnn takes no segment ids (packed or left-padded rows), only prefix lengths"
        if spec.softcap is not None:
            return "cudnn has no soft cap"
        if features.sinks:
            return "cudnn has no attention sinks"
        if features.dtype not in ("bfloat16", "float16"):
            return f"cudnn computes in bfloat16 or float16, not {features.dtype}"
        if features.head_dim % 8 or features.head_dim > 128:
            return f"cudnn needs a head size that is a multiple of 8 up to 128 (this one is {features.head_dim})"
        return None
    raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}")


def attention_backend(requested: str, platform: str, features: Features) -> tuple[str, str]:
    """`(backend, reason)`: the backend that runs an attention with `features` on `platform` (`cpu`, `gpu`/`cuda`/
    `rocm`, `tpu`) when `requested` is `auto` (the platform's Pallas kernel, else cuDNN on NVIDIA, where they cover
    the features; else xla; xla on the CPU), `xla`, `pallas` (the platform's kernel; on the CPU the GPU kernel in the
    interpreter) or `cudnn`; a concrete name of `BACKENDS` is taken as it is. A kernel that cannot express the
    features falls back to `xla`; `reason` is one line, e.g. `"xla: pallas_gpu has no soft cap"`."""
    if requested in BACKENDS and requested not in REQUESTS:
        why = kernel_unsupported(requested, features)
        return ("xla", f"xla: {why}") if why else (requested, f"{requested}: requested")
    if requested not in REQUESTS:
        raise ValueError(f"attention must be one of {', '.join(REQUESTS + BACKENDS)}, not {requested!r}")
    if requested == "xla":
        return "xla", "xla: requested"
    gpu, tpu = platform in _GPU_PLATFORMS, platform == "tpu"
    if requested == "cudnn":
        candidates = ["cudnn"] if platform in ("gpu", "cuda") else []
        none = f"no cuDNN on {platform}"
    elif requested == "pallas":
        candidates = ["pallas_gpu" if gpu else "pallas_tpu" if tpu else "pallas_interpret"]
        none = ""
    else:
        candidates = (["pallas_gpu"] + (["cudnn"] if platform in ("gpu", "cuda") else []) if gpu
                      else ["pallas_tpu"] if tpu else [])
        none = f"no kernel on {platform}"
    reasons = []
    for backend in candidates:
        why = kernel_unsupported(backend, features)
        if why is None:
            return backend, f"{backend}: {'the platform kernel' if requested == 'auto' else 'requested'}"
        reasons.append(why)
    return "xla", "xla: " + ("; ".join(reasons) or none)


def describe(choices: dict[str, tuple[str, str]]) -> str:
    """A header clause for the attention of each layer kind, `choices {kind name: attention_backend(...)}`:
    e.g. `"Pallas GPU flash (segment ids)"`, `"XLA (chunked, no kernel on cpu)"`, or, where kinds differ,
    `"global Pallas GPU flash (segment ids); sliding XLA (chunked, pallas_gpu has no sliding window)"`."""
    def one(backend: str, reason: str) -> str:
        if backend != "xla":
            return NAMES[backend]
        why = reason.removeprefix("xla: ")
        return "XLA (chunked)" if why == "requested" else f"XLA (chunked, {why})"

    texts = {kind: one(*choice) for kind, choice in choices.items()}
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    return "; ".join(f"{kind} {text}" for kind, text in texts.items())


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, spec: AttentionSpec = AttentionSpec(),
              *, sinks: jax.Array | None = None, backend: str = "xla", query_chunk: int = 0,
              compute_dtype: jnp.dtype | str = jnp.float32, block: int | None = None) -> jax.Array:
    """The seam: `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]` under `mask` and `spec` -> `[B, T, H * hd]` in the
    activation dtype of `compute_dtype`, on `backend` (see the module's docstring; a kernel that cannot express the
    call runs `xla`). `query_chunk` is the xla path's (`xla_attention`); `block` the kernels' tile along the
    sequence (default: their own), the sequence padded up to a multiple of it."""
    with jax.named_scope("attention"):  # a profile's op kinds (bench/update_profile.py) read the scopes
        return _attention(q, k, v, mask, spec, sinks, backend, query_chunk, compute_dtype, block)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, spec: AttentionSpec,
               sinks: jax.Array | None, backend: str, query_chunk: int, compute_dtype: jnp.dtype | str,
               block: int | None) -> jax.Array:
    if backend != "xla" and kernel_unsupported(backend, features_of(spec, q, k, mask, sinks, compute_dtype)):
        backend = "xla"
    if backend == "xla":
        return xla_attention(q, k, v, mask, spec, sinks=sinks, query_chunk=query_chunk, compute_dtype=compute_dtype)
    if backend in ("pallas_gpu", "pallas_interpret"):
        return pallas_gpu_attention(q, k, v, mask, spec, compute_dtype=compute_dtype, block=block,
                                    interpret=backend == "pallas_interpret")
    if backend in ("pallas_tpu", "pallas_tpu_interpret"):
        return splash_attention(q, k, v, mask, spec, sinks=sinks, compute_dtype=compute_dtype, block=block,
                                interpret=backend == "pallas_tpu_interpret")
    if backend == "cudnn":
        return cudnn_attention(q, k, v, mask, spec, compute_dtype=compute_dtype)
    raise ValueError(f"unknown attention backend {backend!r}; known: {', '.join(BACKENDS)}")


def chunk_allowed(mask: AttentionMask, spec: AttentionSpec, start: jax.Array | int, size: int, keys: int,
                  key_start: jax.Array | int = 0) -> jax.Array:
    """Boolean `[B, size, keys]`: queries `start ... start + size - 1` (slots `q_offset + start + i`, or their
    `q_slots`) against key slots `key_start ... key_start + keys - 1`: `q_seg == kv_seg > 0`, `k_slot <= q_slot`
    (causal), `q_slot - k_slot < W` (window)."""
    q_seg = jax.lax.dynamic_slice_in_dim(mask.q_segments, start, size, axis=1)
    # A Python 0 keeps the static slice (and the program) of the paths that read keys from slot 0.
    origin = isinstance(key_start, int) and key_start == 0
    kv_seg = (mask.kv_segments[:, :keys] if origin
              else jax.lax.dynamic_slice_in_dim(mask.kv_segments, key_start, keys, axis=1))
    allowed = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg > 0)[:, None, :]
    if not spec.causal and spec.window is None:
        return allowed
    k_slot = (jnp.arange(keys) if origin else key_start + jnp.arange(keys))[None, None, :]  # [1, 1, keys]
    if mask.q_slots is not None:  # [B, size, 1]
        q_slot = jax.lax.dynamic_slice_in_dim(mask.q_slots, start, size, axis=1)[:, :, None]
    else:  # [1, size, 1]
        q_slot = ((0 if mask.q_offset is None else mask.q_offset) + start + jnp.arange(size))[None, :, None]
    if spec.causal:
        allowed &= k_slot <= q_slot
    if spec.window is not None:
        allowed &= q_slot - k_slot < spec.window
    return allowed


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, spec: AttentionSpec = AttentionSpec(),
                  *, sinks: jax.Array | None = None, query_chunk: int = 0,
                  compute_dtype: jnp.dtype | str = jnp.float32) -> jax.Array:
    """The reference: `layers.attention_block` per chunk of queries, the mask built per chunk.

    `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]` -> `[B, T, H * hd]`. `query_chunk > 0` and `T > query_chunk`: chunks
    of `query_chunk` queries (`lax.map`, each under `jax.checkpoint`), so scores live as `[B, H, chunk, S]` and the
    mask as `[B, chunk, S]`, forward and backward. `causal` self-attention (no `q_offset`, `S = T`) skips the scores
    above the diagonal, one of two ways:
    - `T <= UNROLLED_LENGTH`: the chunk `[a, b)` reads keys `[0, b)` only, unrolled with those static extents
      (a query that attends to nothing gets the mean of its chunk's values instead of all values, and no real
      query reads it). XLA keeps every chunk's scores alive at once: memory quadratic in `T`.
    - longer: `blocked_attention` in blocks of `query_chunk` (block pairs off the mask skipped, an online softmax, a
      flash backward): memory linear in `T`, the same function within float32 rounding at every real query.

    The rule, measured on a 2-core CPU (jitted value and gradient of this function alone, one row, 9 heads on 3 key
    heads of 64, bfloat16 dots; compiled temp memory, best of 3-7 runs; `unrolled | blocked`):

        T      chunk  chunks   unrolled          blocked
        512    128    4        18 MiB   11 ms    5 MiB   18 ms
        512    256    2        22 MiB   15 ms    11 MiB  14 ms
        1024   128    8        64 MiB   123 ms   7 MiB   73 ms
        1024   256    4        69 MiB   76 ms    13 MiB  44 ms
        1024   512    2        101 MiB  113 ms   36 MiB  97 ms
        2048   128    16       247 MiB  478 ms   11 MiB  286 ms
        2048   512    4        329 MiB  692 ms   40 MiB  412 ms
        4096   128    32       969 MiB  1986 ms  18 MiB  1121 ms
        4096   512    8        1138 MiB 1505 ms  47 MiB  1485 ms

    (the `lax.map` path over all keys: 42 MiB 750 ms at 2048/128, 264 MiB 4819 ms at 4096/512). The GSM8K preset's
    shape (Qwen2.5-0.5B heads 14 on 2, `T = 767`, chunks of 64) at 8 rows: unrolled 486 MiB 811 ms, blocked 138 MiB
    646 ms. Only the shortest contexts are faster unrolled (no per-block loop), so they stay so; the default GRPO
    bench (`T = 63`, one chunk) is not chunked at all."""
    t, s = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    if query_chunk and t > query_chunk:  # the chunks' masks stay in their chunks (`_tied`)
        mask, q = _tied(mask, q)

    def block(q_part: jax.Array, start: jax.Array | int, keys: int) -> jax.Array:
        allowed = chunk_allowed(mask, spec, start, q_part.shape[1], keys)
        return attention_block(q_part, k[:, :keys], v[:, :keys], allowed, scale, spec.softcap, compute_dtype, sinks)

    if not query_chunk or t <= query_chunk:
        return block(q, 0, s)
    if spec.causal and s == t and mask.q_offset is None and mask.q_slots is None:
        if t > UNROLLED_LENGTH:
            return blocked_attention(q, k, v, mask, spec, sinks=sinks, block=query_chunk,
                                     compute_dtype=compute_dtype)
        return jnp.concatenate([jax.checkpoint(functools.partial(block, q[:, a:b], a, b))()
                                for a, b in ((a, min(a + query_chunk, t)) for a in range(0, t, query_chunk))], axis=1)
    n_full, rem = divmod(t, query_chunk)

    def chunk(start: jax.Array | int, size: int) -> jax.Array:
        return block(jax.lax.dynamic_slice_in_dim(q, start, size, axis=1), start, s)

    blocks = jax.lax.map(jax.checkpoint(lambda start: chunk(start, query_chunk)),
                         jnp.arange(n_full, dtype=jnp.int32) * query_chunk)  # [n, B, chunk, H * hd]
    out = jnp.moveaxis(blocks, 0, 1).reshape(q.shape[0], n_full * query_chunk, -1)
    if rem:
        out = jnp.concatenate([out, jax.checkpoint(lambda: chunk(n_full * query_chunk, rem))()], axis=1)
    return out


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                      spec: AttentionSpec = AttentionSpec(), *, sinks: jax.Array | None = None, block: int = 128,
                      compute_dtype: jnp.dtype | str = jnp.float32) -> jax.Array:
    """Flash attention in XLA: `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]` -> `[B, T, H * hd]`, `block` queries
    against `block` keys at a time, skipping every block pair the mask forbids entirely; memory linear in `T, S`.

    The queries and keys are padded (segment 0) to `n_q = ceil(T / block)` and `n_k = ceil(S / block)` blocks.
    Query block `i` (`lax.map`) runs a `lax.scan` over key blocks `j`; the pair's mask `[B, block, block]`
    (`chunk_allowed` over keys `[j block, (j + 1) block)`) gates a `lax.cond`: a pair with no allowed entry in any
    row (above the causal diagonal, outside every window, no shared segment) is skipped, about half the pairs of
    causal self-attention. The state is an online softmax in float32 over `x = mask(softcap(scale * q . k))`:

        m' = max(m, max_s x_s),   l' = l e^(m - m') + sum_s p_s,   acc' = acc e^(m - m') + sum_s p_s v_s,
        p_s = e^(x_s - m') where allowed, else 0 (a fully masked block adds nothing),

    `out = acc / l`; `sinks [H]` join the denominator at the end, `out = acc e^(m - M) / (l e^(m - M) +
    e^(sink - M))` with `M = max(m, sink)` (`layers.masked_softmax`). GQA groups the queries `[B, block, KVH, G,
    hd]` against their key head; the dots are `precision.einsum`s in `compute_dtype` with float32 results.

    The backward is flash attention's (`_blocked_bwd`), not autodiff of the scan: the forward keeps only `out` and
    each row's log-sum-exp `lse` (`[B, T, H, hd]` and `[B, H, T]`), and the same block pairs recompute
    `p = e^(x - lse)`. A query that attends to nothing (padding; no real query reads it) gets 0, where the dense
    softmax gives the mean of the values."""
    b, t, h, hd = q.shape
    s, kvh = k.shape[1], k.shape[2]
    n_q, n_k = -(-t // block), -(-s // block)
    # Padding queries and keys sit in segment 0, which the mask never allows.
    padded = AttentionMask(_pad_sequence(mask.q_segments.astype(jnp.int32), n_q * block),
                           _pad_sequence(mask.kv_segments.astype(jnp.int32), n_k * block), mask.q_offset,
                           None if mask.q_slots is None else _pad_sequence(mask.q_slots, n_q * block))
    grouped = _pad_sequence(q, n_q * block).reshape(b, n_q * block, kvh, h // kvh, hd)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kvh, h // kvh)
    static = _Blocked(spec, block, jnp.dtype(compute_dtype).name, hd ** -0.5 if spec.scale is None else spec.scale)
    out = _blocked(static, grouped, _pad_sequence(k, n_k * block), _pad_sequence(v, n_k * block), sink, padded)
    return out[:, :t].reshape(b, t, h * hd).astype(precision.activation_dtype(compute_dtype))


@dataclasses.dataclass(frozen=True)
class _Blocked:
    """`blocked_attention`'s static part."""

    spec: AttentionSpec
    block: int
    dtype: str
    scale: float


def _block_logits(static: _Blocked, q_i: jax.Array, k_j: jax.Array, allowed: jax.Array) -> tuple[jax.Array, ...]:
    """`(z, x)`: the scaled scores `z = scale * q_i . k_j` and the masked, capped logits `x`, `[B, KVH, G, bq, bk]`
    of `q_i [B, bq, KVH, G, hd]`, `k_j [B, bk, KVH, hd]`, `allowed [B, 1, 1, bq, bk]`."""
    z = precision.einsum("btkgd,bskd->bkgts", q_i, k_j, static.dtype, jnp.float32) * static.scale
    return z, jnp.where(allowed, softcap(z, static.spec.softcap), MASKED)


def _pair_allowed(static: _Blocked, mask: AttentionMask, i: jax.Array, j: jax.Array) -> jax.Array:
    """The mask of query block `i` against key block `j`, `[B, 1, 1, block, block]` (against the grouped heads)."""
    block = static.block
    return chunk_allowed(mask, static.spec, i * block, block, block, j * block)[:, None, None]


def _tied(mask: AttentionMask, q: jax.Array) -> tuple[AttentionMask, jax.Array]:
    """`(mask, q)` through one `optimization_barrier`: the block masks then depend on the queries, so the mask work
    stays inside the loops that use it. Without it, inside a scan (the decoder's layer stack) the block loops' mask
    and bias, which depend on the segment ids alone, were hoisted and kept for every block pair at once: SmolLM2's
    forward and backward at 8k tokens held 6.4 GiB of them (221 MiB with the barrier)."""
    return jax.lax.optimization_barrier((mask, q))


def _blocked_forward(static: _Blocked, q: jax.Array, k: jax.Array, v: jax.Array, sink: jax.Array | None,
                     mask: AttentionMask) -> tuple[jax.Array, jax.Array]:
    """`(out [B, n_q block, KVH, G, hd], lse [n_q, B, KVH, G, block])` in float32 (the online softmax of
    `blocked_attention`); a row that attends to nothing has `out = 0` and `lse = 0` (or its sink)."""
    block = static.block
    b, _, kvh, group, hd = q.shape
    n_k = k.shape[1] // block
    mask, q = _tied(mask, q)

    def query_block(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        q_i = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)

        def step(state: tuple[jax.Array, ...], j: jax.Array) -> tuple[tuple[jax.Array, ...], None]:
            allowed = _pair_allowed(static, mask, i, j)

            def attend(state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
                m, den, acc = state
                k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=1) for x in (k, v))
                _, x = _block_logits(static, q_i, k_j, allowed)
                m_new = jnp.maximum(m, jnp.max(x, axis=-1))
                p = jnp.where(allowed, jnp.exp(x - m_new[..., None]), 0.0)
                decay = jnp.exp(m - m_new)
                pv = precision.einsum("bkgts,bskd->bkgtd", p, v_j, static.dtype, jnp.float32)
                return m_new, den * decay + jnp.sum(p, axis=-1), acc * decay[..., None] + pv

            return jax.lax.cond(jnp.any(allowed), attend, lambda state: state, state), None

        # MASKED, not -inf, as the empty max: e^(m - m') stays 1 (not NaN) while a row has seen nothing.
        rows = (b, kvh, group, block)
        state = (jnp.full(rows, MASKED, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros((*rows, hd), jnp.float32))
        (m, den, acc), _ = jax.lax.scan(step, state, jnp.arange(n_k, dtype=jnp.int32))
        if sink is not None:
            top = jnp.maximum(m, sink[..., None])
            total = den * jnp.exp(m - top) + jnp.exp(sink[..., None] - top)
            out, lse = acc * (jnp.exp(m - top) / total)[..., None], top + jnp.log(total)
        else:  # a row that saw nothing has den = 0 and acc = 0: out 0, lse 0 (its p in the backward is masked)
            seen = den > 0
            out = acc / jnp.where(seen, den, 1.0)[..., None]
            lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), 0.0)
        return jnp.moveaxis(out, 3, 1), lse  # [B, block, KVH, G, hd], [B, KVH, G, block]

    out, lse = jax.lax.map(query_block, jnp.arange(q.shape[1] // block, dtype=jnp.int32))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape[:2] + out.shape[3:]), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked(static: _Blocked, q: jax.Array, k: jax.Array, v: jax.Array, sink: jax.Array | None,
             mask: AttentionMask) -> jax.Array:
    return _blocked_forward(static, q, k, v, sink, mask)[0]


def _blocked_fwd(static: _Blocked, q: jax.Array, k: jax.Array, v: jax.Array, sink: jax.Array | None,
                 mask: AttentionMask) -> tuple[jax.Array, tuple]:
    out, lse = _blocked_forward(static, q, k, v, sink, mask)
    return out, (q, k, v, sink, mask, out, lse)


def _blocked_bwd(static: _Blocked, residuals: tuple, d_out: jax.Array) -> tuple:
    """Flash attention's backward over the forward's block pairs, per pair (`D = rowsum(d_out * out)`):

        p = e^(x - lse),  dv_j += p^T d_out_i,  dx = p (d_out_i . v_j - D),  dz = dx (1 - tanh^2(z / cap)) (soft cap),
        dq_i += scale dz k_j,  dk_j += scale dz^T q_i,  d sink = -sum_rows e^(sink - lse) D.

    Query blocks are a `lax.scan` carrying `dk, dv [B, S, KVH, hd]` (float32), key blocks a `lax.scan` carrying
    `dq_i`; a skipped pair adds nothing."""
    q, k, v, sink, mask, out, lse = residuals
    mask, q = _tied(mask, q)
    block, cap = static.block, static.spec.softcap
    b, _, kvh, group, hd = q.shape
    n_q, n_k = q.shape[1] // block, k.shape[1] // block
    d_out = d_out.astype(jnp.float32)
    by_block = (lambda x: jnp.moveaxis(x.reshape(b, n_q, block, *x.shape[2:]), 1, 0))  # [n_q, B, block, ...]
    d_blocks = by_block(d_out)
    rowsum = jnp.moveaxis(by_block(jnp.sum(d_out * out, axis=-1)), 2, -1)  # D: [n_q, B, KVH, G, block]

    def query_block(grads: tuple[jax.Array, ...], xs: tuple[jax.Array, ...]
                    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        d_k, d_v, d_sink = grads
        i, do_i, lse_i, rowsum_i = xs
        q_i = jax.lax.dynamic_slice_in_dim(q, i * block, block, axis=1)

        def key_block(dq_i: jax.Array, j: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            allowed = _pair_allowed(static, mask, i, j)

            def pair(dq_i: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
                k_j, v_j = (jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=1) for x in (k, v))
                z, x = _block_logits(static, q_i, k_j, allowed)
                p = jnp.where(allowed, jnp.exp(x - lse_i[..., None]), 0.0)
                dv_j = precision.einsum("bkgts,btkgd->bskd", p, do_i, static.dtype, jnp.float32)
                dp = precision.einsum("btkgd,bskd->bkgts", do_i, v_j, static.dtype, jnp.float32)
                dz = p * (dp - rowsum_i[..., None])
                if cap is not None:  # d/dz cap tanh(z / cap) = 1 - tanh^2 (of z: x is MASKED off the mask)
                    dz = dz * (1.0 - jnp.square(jnp.tanh(z / cap)))
                dz = dz * static.scale
                dq_i = dq_i + precision.einsum("bkgts,bskd->btkgd", dz, k_j, static.dtype, jnp.float32)
                return dq_i, (precision.einsum("bkgts,btkgd->bskd", dz, q_i, static.dtype, jnp.float32), dv_j)

            def skip(dq_i: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
                zero = jnp.zeros((b, block, kvh, hd), jnp.float32)
                return dq_i, (zero, zero)

            return jax.lax.cond(jnp.any(allowed), pair, skip, dq_i)

        dq_i, (dk_i, dv_i) = jax.lax.scan(key_block, jnp.zeros((b, block, kvh, group, hd), jnp.float32),
                                          jnp.arange(n_k, dtype=jnp.int32))
        d_k = d_k + jnp.moveaxis(dk_i, 0, 1).reshape(d_k.shape)
        d_v = d_v + jnp.moveaxis(dv_i, 0, 1).reshape(d_v.shape)
        if sink is not None:
            d_sink = d_sink - jnp.sum(jnp.exp(sink[..., None] - lse_i) * rowsum_i, axis=(0, 3))
        return (d_k, d_v, d_sink), dq_i

    zeros = jnp.zeros(k.shape, jnp.float32)
    init = (zeros, zeros, jnp.zeros((kvh, group), jnp.float32))
    (d_k, d_v, d_sink), d_q = jax.lax.scan(query_block, init,
                                           (jnp.arange(n_q, dtype=jnp.int32), d_blocks, lse, rowsum))
    d_q = jnp.moveaxis(d_q, 0, 1).reshape(q.shape)
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
            None if sink is None else d_sink.astype(sink.dtype), None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _pad_sequence(x: jax.Array, length: int) -> jax.Array:
    """`x [B, T, ...]` zero-padded along axis 1 to `length`."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pallas_gpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                         spec: AttentionSpec = AttentionSpec(), *, compute_dtype: jnp.dtype | str = jnp.float32,
                         block: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas' Triton flash attention (`mha`) of self-attention `q [B, T, H, hd]`, `k, v [B, T, KVH, hd]` with
    segment ids `mask.kv_segments [B, T]` (queries' too) -> `[B, T, H * hd]`. `mha` reads key head `h` for query
    head `h`, so keys and values are repeated to `[B, T, H, hd]` (linear in `T`; its backward sums the groups back).
    The sequence is padded with segment 0 to a multiple of `block` (default 128; no real query sees the padding);
    the backward's tiles are `min(block, 32)` (the kernel's defaults)."""
    b, t, h, hd = q.shape
    group = h // k.shape[2]
    block = block or 128
    length = _round_up(t, block)
    back = min(block, 32)
    sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=back, block_kv_dkv=back,
                                     block_q_dq=back, block_kv_dq=back)
    dtype = jnp.dtype(compute_dtype)
    q, k, v = (_pad_sequence(x.astype(dtype), length) for x in (q, k, v))
    k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
    segments = _pad_sequence(mask.kv_segments.astype(jnp.int32), length)
    scale = hd ** -0.5 if spec.scale is None else spec.scale
    out = gpu_attention.mha(q, k, v, segments, sm_scale=scale, causal=spec.causal, block_sizes=sizes,
                            interpret=interpret)
    return out[:, :t].reshape(b, t, h * hd).astype(precision.activation_dtype(dtype))


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads: int, length: int, causal: bool, window: int | None, softcap: float | None, block: int,
                   interpret: bool) -> splash.SplashAttentionKernel:
    """The splash kernel of `heads` query heads over `length` slots (its block-sparsity tables are built on the host,
    once per shape and mask)."""
    shape = (length, length)
    if window is not None:
        base: splash_mask.Mask = splash_mask.LocalMask(shape, (window - 1, 0), 0)  # causal, `t - s < W`
    elif causal:
        base = splash_mask.CausalMask(shape)
    else:
        base = splash_mask.FullMask(shape)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Concrete tables even when first built inside a trace (a `cond` branch): the cached kernel outlives it.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(splash_mask.MultiHeadMask([base] * heads), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                     spec: AttentionSpec = AttentionSpec(), *, sinks: jax.Array | None = None,
                     compute_dtype: jnp.dtype | str = jnp.float32, block: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """Splash attention (TPU) of self-attention `q [B, T, H, hd]`, `k, v [B, T, KVH, hd]` with segment ids
    `mask.kv_segments [B, T]` -> `[B, T, H * hd]`: GQA natively (`[KVH, T, hd]` keys), causal or local masks, the
    soft cap and `sinks [H]` in the kernel. The kernel takes no scale: `q` is scaled first (in float32, then cast).
    One row at a time (`vmap`); the sequence is padded with segment 0 to a multiple of `block` (a multiple of 128;
    default `min(512, T rounded up to 128)`)."""
    b, t, h, hd = q.shape
    block = block or min(512, _round_up(t, 128))
    length = _round_up(t, block)
    dtype = jnp.dtype(compute_dtype)
    scale = hd ** -0.5 if spec.scale is None else spec.scale
    kernel = _splash_kernel(h, length, spec.causal, spec.window, spec.softcap, block, interpret)
    qh = _pad_sequence((q.astype(jnp.float32) * scale).astype(dtype), length).transpose(0, 2, 1, 3)
    kh, vh = (_pad_sequence(x.astype(dtype), length).transpose(0, 2, 1, 3) for x in (k, v))
    segments = _pad_sequence(mask.kv_segments.astype(jnp.int32), length)
    row_sinks = None if sinks is None else sinks.astype(jnp.float32)

    def row(q_row: jax.Array, k_row: jax.Array, v_row: jax.Array, seg: jax.Array) -> jax.Array:
        return kernel(q_row, k_row, v_row, segment_ids=splash.SegmentIds(seg, seg), sinks=row_sinks)

    out = jax.vmap(row)(qh, kh, vh, segments)  # [B, H, length, hd]
    return out[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, h * hd).astype(precision.activation_dtype(dtype))


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                    spec: AttentionSpec = AttentionSpec(), *, compute_dtype: jnp.dtype | str = jnp.bfloat16
                    ) -> jax.Array:
    """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) of self-attention
    `q [B, T, H, hd]`, `k, v [B, T, KVH, hd]` (GQA natively) whose rows are prefixes (`layout="prefix"`): each row's
    length is its count of `kv_segments > 0`; a window `W` is cuDNN's left window `W - 1`. -> `[B, T, H * hd]`."""
    b, t, h, hd = q.shape
    dtype = jnp.dtype(compute_dtype)
    lengths = jnp.sum(mask.kv_segments > 0, axis=1).astype(jnp.int32)
    window = None if spec.window is None else (spec.window - 1, 0)
    out = jax.nn.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), scale=spec.scale,
                                       is_causal=spec.causal, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, local_window_size=window,
                                       implementation="cudnn")
    return out.reshape(b, t, h * hd).astype(precision.activation_dtype(dtype))
