"""The transformer block, written once.

    h = attn_norm(x);  q, k, v = qkv(h);  q, k = q_norm(q), k_norm(k)            (Qwen3, Gemma 3)
    q, k = rotary(q), rotary(k);  a, state = attend(q, k, v)
    x = x + attn_post_norm(o(a))                                                 (post norm: Gemma 2/3)
    x = x + mlp_post_norm(down(act(gate) * up)),  gate, up = gate_up(mlp_norm(x))
                                                   (or act(gate) * up in one op: `LayerOps.gated`)

Two things vary between the places a block runs, and both are arguments:
- **how the weights are applied** (`LayerOps`): the Flax modules of `decoder.py` (training, the reference
  forward and the prefill: separate q, k, v and gate, up matrices, unmerged LoRA factors, dropout), or the
  sampler's prepared weights (`decode.step_ops`: q|k|v and gate|up fused into one matmul each);
- **where keys and values live** (`Attend`): none (a full sequence), the decoder's `[B, S, KVH, hd]` cache
  (`cached_attention`), or the decode loop's transposed per-layer caches (`decode.loop_cache_attention`).

So a model family's block feature (a norm, a bias, a soft cap, a rotary variant) is written here or in
`layers.py` once, and every path runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import apply_rope, gated_activation, grouped_query_attention

Fn = Callable[[jax.Array], jax.Array]
# `attend(q [B, T, H, hd], k [B, T, KVH, hd], v [B, T, KVH, hd]) -> (out [B, T, H * hd], state)`: q and k rotated;
# `state` is whatever the keys and values were written to (an updated cache, or None).
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


class LayerOps(NamedTuple):
    """One layer's weights as functions of activations `[B, T, D]`: `qkv` returns `q [B, T, H, hd]` and
    `k, v [B, T, KVH, hd]`; `gate_up` returns `gate, up [B, T, I]`; absent parts (a family without q/k norms or
    sandwich norms) are None. `gated`, where given, returns `act(gate) * up [B, T, I]` of its input in one op (the
    engine's AMX kernel computes it in its matmul's epilogue) and stands in for `gate_up` and the activation."""

    attn_norm: Fn
    qkv: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
    q_norm: Fn | None
    k_norm: Fn | None
    o: Fn
    attn_post_norm: Fn | None
    mlp_norm: Fn
    gate_up: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    down: Fn
    mlp_post_norm: Fn | None
    gated: Fn | None = None


def transformer_block(x: jax.Array, ops: LayerOps, attend: Attend, cos: jax.Array, sin: jax.Array,
                      config: ModelConfig) -> tuple[jax.Array, Any]:
    """The pre-norm block above on `x [B, T, D]` with rotary tables `cos, sin [B, T, rot]` (the layer kind's):
    returns `(x [B, T, D], attend's state)`."""
    q, k, v = ops.qkv(ops.attn_norm(x))
    if ops.q_norm is not None and ops.k_norm is not None:
        q, k = ops.q_norm(q), ops.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, state = attend(q, k, v)
    h = ops.o(out)
    if ops.attn_post_norm is not None:
        h = ops.attn_post_norm(h)
    x = x + h
    h = ops.mlp_norm(x)
    h = ops.down(ops.gated(h) if ops.gated is not None else gated_activation(*ops.gate_up(h), config.hidden_act))
    if ops.mlp_post_norm is not None:
        h = ops.mlp_post_norm(h)
    return x + h, state


def cached_attention(config: ModelConfig, allowed: jax.Array, cache: dict[str, jax.Array] | None = None,
                     cache_index: jax.Array | int = 0) -> Attend:
    """Grouped-query attention of `T` queries over the decoder's cache layout: the new keys and values are
    written to `cache {"k", "v": [B, S, KVH, hd]}` at slots `cache_index ... cache_index + T - 1` and the queries
    attend to the whole cache under `allowed [B, T, S]`; without a cache they attend to themselves (`S = T`)."""
    c = config

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        new = cache
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), cache_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), cache_index, axis=1)
            new = {"k": k, "v": v}  # the cache's dtype: attention's dots cast their operands to the compute dtype
        out = grouped_query_attention(q, k, v, allowed, query_chunk=c.attention_query_chunk,
                                      scale=c.attention_scale, logit_softcap=c.attn_logit_softcap,
                                      compute_dtype=c.jnp_dtype, causal=cache is None)
        return out, new

    return attend
