"""The attention the training seam (jaxrl_llm/models/attention.py) must equal, written from its definition: the
dense boolean masks of left-padded rows, a cache and packed rows, and one unchunked softmax attention under such
a mask. Nothing here is shared with the library's attention code, so a bug there cannot hide in both."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_allowed(key_mask: jax.Array, num_queries: int, cache_index: jax.Array | int,
                      sliding_window: int | None) -> jax.Array:
    """Boolean `[B, T, S]` of left-padded rows or a cache: query `t` (at slot `cache_index + t`) may attend to key
    slot `s` when `s <= cache_index + t`, the key is valid (`key_mask [B, S]`), and with a window `W`,
    `cache_index + t - s < W`."""
    q_slot = cache_index + jnp.arange(num_queries)[:, None]
    k_slot = jnp.arange(key_mask.shape[-1])[None, :]
    allowed = k_slot <= q_slot
    if sliding_window is not None:
        allowed &= q_slot - k_slot < sliding_window
    return allowed[None] & key_mask.astype(bool)[:, None, :]


def segment_attention_allowed(segments: jax.Array, sliding_window: int | None) -> jax.Array:
    """Boolean `[B, T, T]` of packed rows (`segments [B, T]`: sequence `k > 0`, or 0 on padding, each sequence's
    tokens contiguous): block-diagonal causal, a query attends to the earlier keys of its own sequence (with a
    window `W`, fewer than `W` positions back: within a sequence, index distance is position distance)."""
    idx = jnp.arange(segments.shape[-1])
    allowed = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        allowed &= idx[:, None] - idx[None, :] < sliding_window
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    return allowed[None] & same


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float | None = None,
                    logit_softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`softmax(softcap(scale q k^T) | allowed) v` in float32, every query against every key at once.

    q `[B, T, H, hd]`, k/v `[B, S, KVH, hd]` (query head `h` reads key head `h // (H / KVH)`), allowed `[B, T, S]`
    -> `[B, T, H * hd]`. `scale` defaults to `hd ** -0.5`; transformers' order: scale, soft cap
    (`cap tanh(x / cap)`), mask. `sinks [H]` (gpt-oss): one more logit per head in each softmax's denominator,
    with no value. A query that may attend to no key is left out of every comparison (its output is never read)."""
    b, t, h, hd = q.shape
    group = h // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))  # [B, S, H, hd]
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * (hd**-0.5 if scale is None else scale)
    if logit_softcap is not None:
        scores = logit_softcap * jnp.tanh(scores / logit_softcap)
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    if sinks is not None:  # the sink as one more key with no value
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], (b, h, t, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(jnp.where(allowed[:, None].any(-1, keepdims=True), scores, 0.0), axis=-1)
        probs = jnp.where(allowed[:, None], probs, 0.0)
    return jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, h * hd)
