"""The model math as pure functions, shared by the Flax decoder (`decoder.py`, training and the reference
pass) and the sampler's token step (`decode.py`): RMSNorm, rotary embeddings (with their scalings), the
attention mask, grouped-query attention, SwiGLU. A model family is written here once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig

# A large finite negative: a fully padded query row then gets a uniform (finite) softmax instead of NaN.
MASKED = -1e30

SUPPORTED_ROPE_SCALING = ("linear", "llama3")


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype | None = None) -> jax.Array:
    """`y = x / sqrt(mean(x^2) + eps) * scale` over the last axis, normalised in float32 (as transformers'
    LlamaRMSNorm), then scaled in `dtype` (default: `x`'s)."""
    dtype = dtype or x.dtype
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * normed.astype(dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated MLP's inner activation: `silu(gate) * up` (the MLP is `down(swiglu(gate(x), up(x)))`)."""
    return jax.nn.silu(gate) * up


def masked_softmax(scores: jax.Array, allowed: jax.Array, head_dim: int) -> jax.Array:
    """`softmax(scores / sqrt(hd))` over the last (key) axis with disallowed keys at `MASKED`, float32;
    `allowed` broadcastable to `scores`."""
    return jax.nn.softmax(jnp.where(allowed, scores / math.sqrt(head_dim), MASKED), axis=-1)


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """`inv_freq [hd/2]` = theta^(-2i/hd), adjusted by `rope_scaling` (transformers' `rope_utils`)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_SCALING)}")


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`cos, sin [B, T, hd]` for integer `positions [B, T]`, computed in float32."""
    inv_freq = jnp.asarray(rope_inverse_frequencies(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`x * cos + rotate_half(x) * sin` (HF convention: the two halves of each head are the pairs), with
    `cos, sin` broadcastable to `x [..., hd]` (cast to `x`'s dtype)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`rotary` for `x [B, T, heads, hd]` with `cos, sin [B, T, hd]` (one rotation per position)."""
    return rotary(x, cos[:, :, None, :], sin[:, :, None, :])


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions `[B, T]` of a left-padded batch: `cumsum(mask) - 1`, 0 on padding."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def attention_allowed(
    key_mask: jax.Array, num_queries: int, cache_index: jax.Array | int, sliding_window: int | None
) -> jax.Array:
    """Boolean `[B, T, S]`: query `t` (slot `cache_index + t`) may attend to key slot `s`."""
    q_slot = cache_index + jnp.arange(num_queries)[:, None]
    k_slot = jnp.arange(key_mask.shape[-1])[None, :]
    allowed = k_slot <= q_slot
    if sliding_window is not None:
        allowed &= q_slot - k_slot < sliding_window
    return allowed[None] & key_mask.astype(bool)[:, None, :]


def grouped_query_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, query_chunk: int = 0
) -> jax.Array:
    """softmax(q k^T / sqrt(hd)) v with GQA.

    q `[B, T, H, hd]`, k/v `[B, S, KVH, hd]`, allowed `[B, T, S]` -> `[B, T, H * hd]`. Scores and softmax
    in float32; each group of `H / KVH` query heads shares one key/value head.

    `query_chunk > 0` and `T > query_chunk`: the queries are taken `query_chunk` at a time (`lax.map`, each chunk
    under `jax.checkpoint`), so the float32 scores live as `[B, H, query_chunk, S]` blocks, forward and backward,
    not `[B, H, T, S]`. Each query's softmax still runs over all its keys: the result is the same function.
    """
    t = q.shape[1]
    if not query_chunk or t <= query_chunk:
        return _attention_block(q, k, v, allowed)
    n_full, rem = divmod(t, query_chunk)

    def chunk(start: jax.Array | int, size: int) -> jax.Array:
        return _attention_block(jax.lax.dynamic_slice_in_dim(q, start, size, axis=1), k, v,
                                jax.lax.dynamic_slice_in_dim(allowed, start, size, axis=1))

    blocks = jax.lax.map(jax.checkpoint(lambda start: chunk(start, query_chunk)),
                         jnp.arange(n_full, dtype=jnp.int32) * query_chunk)  # [n, B, chunk, H * hd]
    out = jnp.moveaxis(blocks, 0, 1).reshape(q.shape[0], n_full * query_chunk, -1)
    if rem:
        out = jnp.concatenate([out, jax.checkpoint(lambda: chunk(n_full * query_chunk, rem))()], axis=1)
    return out


def _attention_block(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    probs = masked_softmax(scores, allowed[:, None, None], hd).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h * hd)


