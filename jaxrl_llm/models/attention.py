"""Training attention behind one seam, with the mask given as what it is (DESIGN 13, 14).

    out[b, t, h] = softmax_s(mask(softcap(scale * q[b, t, h] . k[b, s, h // G]))) . v[b, s, h // G]

`q [B, T, H, hd]`, `k, v [B, S, KVH, hd]`, `G = H / KVH` query heads per key head, `out [B, T, H * hd]`. Query `t`
sits in slot `q_offset + t` (or its own `q_slots[b, t]`: the engine's prefill chunks); key `s` in slot `s`. The mask
is never an array of its own: query `t` may attend to key `s` when

    q_segments[b, t] == kv_segments[b, s] > 0                         (same sequence, not padding)
    and s <= q_offset + t                                             (`causal`)
    and q_offset + t - s < W                                          (a sliding window `W`)

(`AttentionMask`). A packed row is several segments `1, 2, ...` then 0s (`q_segments = kv_segments`); a left-padded
row, or a cache, is `kv_segments = key_mask` with every query in segment 1 (`AttentionMask.padded`), which is
`layers.attention_allowed`; packed rows are `layers.segment_attention_allowed`. `sinks [H]` (gpt-oss) add one
logit per head to each softmax's denominator (`layers.masked_softmax`).

Backends (`attention_backend` picks one per layer kind):
- `xla`: the reference, everywhere: `layers.grouped_query_attention`'s math (float32 scores and softmax, the dots
  `precision.einsum`s in the compute dtype, GQA by grouping the queries, no repeated keys), chunked over queries,
  each chunk's `[B, chunk, S]` mask built from the segment ids and slots inside the chunk: no `[B, T, S]` array
  exists forward or backward once `T > query_chunk`.
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
from jaxrl_llm.models.config import ATTENTION_BACKENDS, ATTENTION_REQUESTS
from jaxrl_llm.models.layers import head_sinks, masked_softmax

BACKENDS = ATTENTION_BACKENDS
REQUESTS = ATTENTION_REQUESTS
LAYOUTS = ("segments", "prefix")
# What a header names each backend.
NAMES = {"xla": "XLA (chunked)", "pallas_gpu": "Pallas GPU flash (segment ids)",
         "pallas_tpu": "Pallas TPU splash (segment ids)", "cudnn": "cuDNN flash (prefix lengths)",
         "pallas_interpret": "Pallas GPU flash, interpreted (segment ids)",
         "pallas_tpu_interpret": "Pallas TPU splash, interpreted (segment ids)"}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


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
        sees the valid keys before it, as `layers.attention_allowed` lets it)."""
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


def chunk_allowed(mask: AttentionMask, spec: AttentionSpec, start: jax.Array | int, size: int, keys: int
                  ) -> jax.Array:
    """Boolean `[B, size, keys]`: queries `start ... start + size - 1` (slots `q_offset + start + i`, or their
    `q_slots`) against key slots `0 ... keys - 1`: `q_seg == kv_seg > 0`, `k_slot <= q_slot` (causal),
    `q_slot - k_slot < W` (window)."""
    q_seg = jax.lax.dynamic_slice_in_dim(mask.q_segments, start, size, axis=1)
    kv_seg = mask.kv_segments[:, :keys]
    allowed = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg > 0)[:, None, :]
    if not spec.causal and spec.window is None:
        return allowed
    if mask.q_slots is not None:  # [B, size, 1] against [1, 1, keys]
        q_slot = jax.lax.dynamic_slice_in_dim(mask.q_slots, start, size, axis=1)[:, :, None]
        k_slot = jnp.arange(keys)[None, None, :]
    else:  # [1, size, 1] against [1, 1, keys]
        q_slot = ((0 if mask.q_offset is None else mask.q_offset) + start + jnp.arange(size))[None, :, None]
        k_slot = jnp.arange(keys)[None, None, :]
    if spec.causal:
        allowed &= k_slot <= q_slot
    if spec.window is not None:
        allowed &= q_slot - k_slot < spec.window
    return allowed


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, spec: AttentionSpec = AttentionSpec(),
                  *, sinks: jax.Array | None = None, query_chunk: int = 0,
                  compute_dtype: jnp.dtype | str = jnp.float32) -> jax.Array:
    """The reference: `layers.grouped_query_attention`'s function and its chunking, the mask built per chunk.

    `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]` -> `[B, T, H * hd]`. `query_chunk > 0` and `T > query_chunk`: chunks
    of `query_chunk` queries (`lax.map`, each under `jax.checkpoint`), so scores live as `[B, H, chunk, S]` and the
    mask as `[B, chunk, S]`, forward and backward. `causal` self-attention (no `q_offset`, `S = T`): the
    chunk `[a, b)` reads keys `[0, b)` only, unrolled with those static extents (as `grouped_query_attention`; a
    query that attends to nothing gets the mean of its chunk's values instead of all values, and no real query
    reads it)."""
    t, s = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale

    def block(q_part: jax.Array, start: jax.Array | int, keys: int) -> jax.Array:
        allowed = chunk_allowed(mask, spec, start, q_part.shape[1], keys)
        return _attention_block(q_part, k[:, :keys], v[:, :keys], allowed, scale, spec.softcap, compute_dtype, sinks)

    if not query_chunk or t <= query_chunk:
        return block(q, 0, s)
    if spec.causal and s == t and mask.q_offset is None and mask.q_slots is None:
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


def _attention_block(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float,
                     softcap: float | None, compute_dtype: jnp.dtype | str, sinks: jax.Array | None) -> jax.Array:
    """`softmax(softcap(scale * q k^T) | allowed) v` of `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]`, `allowed [B, T,
    S]` -> `[B, T, H * hd]`: queries grouped `[B, T, KVH, G, hd]` against their shared key head, scores
    `[B, KVH, G, T, S]` in float32 (`layers._attention_block`, the same ops)."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, h // kvh, hd)
    scores = precision.einsum("btkgd,bskd->bkgts", q, k, compute_dtype, jnp.float32)
    grouped = head_sinks(sinks, kvh)  # [KVH, G, 1] -> [KVH, G, 1, 1] against the scores
    probs = masked_softmax(scores, allowed[:, None, None], scale, softcap,
                           None if grouped is None else grouped[..., None])
    out = precision.einsum("bkgts,bskd->btkgd", probs, v, compute_dtype)
    return out.reshape(b, t, h * hd)


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
