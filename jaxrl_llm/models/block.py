"""The transformer block, written once.

    h = attn_norm(x);  q, k, v = qkv(h);  q, k = q_norm(q), k_norm(k)            (Qwen3, Gemma 3)
    q, k = rotary(q), rotary(k);  a, state = attend(q, k, v, sinks)                (sinks: gpt-oss)
    a = a * sigmoid(gate)                                                        (output gate: Qwen3.5)
    x = x + attn_post_norm(o(a))                                                 (post norm: Gemma 2/3)
    x = x + mlp_post_norm(feed_forward(mlp_norm(x)))

A linear-attention layer (Qwen3.5's Gated DeltaNet, `models/gated_delta.py`) replaces the attention's line by its
token mixer: `m, state = mixer(attn_norm(x)); x = x + m` (`LayerOps.mixer`, which reads and returns the layer's
fixed-size state); the rest of the block is the same.

The feed-forward is a part the family chooses (`LayerOps.feed_forward`): the gated MLP `down(act(gate) * up)`
(`gated_mlp`), or a mixture of experts (`models/moe.py`), which also returns what its router chose.

Two things vary between the places a block runs (each path hands them to the one driver of the layer stack,
`stack.run_layers`), and both are arguments:
- **how the weights are applied** (`LayerOps`): the Flax modules of `sublayers.py` (training, the reference
  forward and the prefill: separate q, k, v and gate, up matrices, unmerged LoRA factors, dropout), or the
  sampler's prepared weights (`step_weights.step_ops`: q|k|v and gate|up fused into one matmul each);
- **where keys and values live** (`Attend`): none (a full sequence), the decoder's `[B, S, KVH, hd]` cache
  (`cached_attention`), or the decode loop's transposed per-layer caches (`decode.loop_cache_attention`).

So a model family's block feature (a norm, a bias, a soft cap, a rotary variant) is written here or in
`layers.py` once, and every path runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models.attention import AttentionMask, AttentionSpec, Features, attention, attention_backend, features_of
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import apply_rope, gated_activation
from jaxrl_llm.models.moe import Routing
from jaxrl_llm.models.sequence_parallel import sequence_attention

Fn = Callable[[jax.Array], jax.Array]
# `feed_forward(h [B, T, D]) -> (y [B, T, D], routing)`: routing is None for a dense MLP, else the `Routing` of the
# layer's tokens (`experts [B, T, k]`, router `logits [B, T, E]`).
FeedForward = Callable[[jax.Array], tuple[jax.Array, Routing | None]]
# `attend(q [B, T, H, hd], k [B, T, KVH, hd], v [B, T, KVH, hd], sinks [H] | None) -> (out [B, T, H * hd], state)`:
# q and k rotated; `sinks` the layer's per-head sink logits (gpt-oss) or None; `state` is whatever the keys and
# values were written to (an updated cache, or None).
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, Any]]
# `mixer(h [B, T, D]) -> (out [B, T, D], state)`: a linear-attention layer's whole token mixing, its state its own.
Mixer = Callable[[jax.Array], tuple[jax.Array, Any]]


class LayerOps(NamedTuple):
    """One layer's weights as functions of activations `[B, T, D]`: `qkv` returns `q [B, T, H, hd]` and
    `k, v [B, T, KVH, hd]` (with an output gate, q is `[B, T, H, 2 hd]`: each head's query, then its gate);
    `feed_forward` the feed-forward part's output (and its routing, see `FeedForward`); `sinks [H]`: the attention's
    sink logits (gpt-oss); `mixer`: a linear-attention layer's token mixer, which replaces qkv, the norms, attend and
    o (then None); absent parts (a family without q/k norms, sandwich norms or sinks) are None."""

    attn_norm: Fn
    qkv: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]] | None
    q_norm: Fn | None
    k_norm: Fn | None
    o: Fn | None
    attn_post_norm: Fn | None
    mlp_norm: Fn
    feed_forward: FeedForward
    mlp_post_norm: Fn | None
    sinks: jax.Array | None = None
    mixer: Mixer | None = None


def gated_mlp(gate_up: Callable[[jax.Array], tuple[jax.Array, jax.Array]], down: Fn, hidden_act: str,
              gated: Fn | None = None) -> FeedForward:
    """The dense feed-forward `down(act(gate) * up)` with `gate, up = gate_up(h)`; `gated(h)`, where given, returns
    `act(gate) * up` in one op (the engine's AMX kernel computes it in its matmul's epilogue)."""
    def feed_forward(h: jax.Array) -> tuple[jax.Array, None]:
        return down(gated(h) if gated is not None else gated_activation(*gate_up(h), hidden_act)), None

    return feed_forward


def transformer_block(x: jax.Array, ops: LayerOps, attend: Attend, cos: jax.Array, sin: jax.Array,
                      config: ModelConfig) -> tuple[jax.Array, Any, Routing | None]:
    """The pre-norm block above on `x [B, T, D]` with rotary tables `cos, sin [B, T, rot]` (the layer kind's):
    returns `(x [B, T, D], attend's (or the mixer's) state, the feed-forward's routing or None)`."""
    if ops.mixer is not None:
        h, state = ops.mixer(ops.attn_norm(x))
    else:
        h, state = _attention(ops.attn_norm(x), ops, attend, cos, sin, config)
    if ops.attn_post_norm is not None:
        h = ops.attn_post_norm(h)
    x = x + h
    h, routing = ops.feed_forward(ops.mlp_norm(x))
    if ops.mlp_post_norm is not None:
        h = ops.mlp_post_norm(h)
    return x + h, state, routing


def _attention(h: jax.Array, ops: LayerOps, attend: Attend, cos: jax.Array, sin: jax.Array, config: ModelConfig
               ) -> tuple[jax.Array, Any]:
    """The block's attention part on the normed `h [B, T, D]`: `(o(attention) [B, T, D], attend's state)`."""
    assert ops.qkv is not None and ops.o is not None
    q, k, v = ops.qkv(h)
    gate = None
    if config.attention_output_gate:  # each head's projection is [query | gate]
        q, gate = jnp.split(q, 2, axis=-1)
    if ops.q_norm is not None and ops.k_norm is not None:
        if config.qk_norm_projection:  # OLMoE: one norm over all heads' queries (keys) together
            q = ops.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
            k = ops.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
        else:
            q, k = ops.q_norm(q), ops.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out, state = attend(q, k, v, ops.sinks)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.reshape(out.shape).astype(jnp.float32)).astype(out.dtype)
    return ops.o(out), state


def attention_spec(config: ModelConfig, local: bool) -> AttentionSpec:
    """The static attention of a layer kind: causal, the model's scale and soft cap, and on a sliding-window layer
    (`local`) its window."""
    return AttentionSpec(causal=True, window=config.sliding_window if local else None,
                         softcap=config.attn_logit_softcap, scale=config.attention_scale)


def layer_kinds_present(config: ModelConfig) -> list[bool]:
    """The layer kinds a model has (False: full attention, True: a sliding window), sorted."""
    return sorted({config.is_sliding(i) for i in range(config.num_layers)})


def training_attention(config: ModelConfig, platform: str | None = None) -> dict[str, tuple[str, str]]:
    """`{kind: (backend, reason)}` of the full-sequence forward (training, the log-prob passes) on `platform`
    (default: JAX's backend), per layer kind (`global`, `sliding`, and a hybrid stack's `linear`), as
    `cached_attention` picks it."""
    platform = platform or jax.default_backend()
    linear = {}
    if config.linear is not None:  # Gated DeltaNet's layers: the chunked rule in XLA on every platform
        linear = {"linear": ("xla", f"xla: the gated delta rule in chunks of {config.linear.chunk}, no kernel yet")}
    return {**_softmax_attention(config, platform), **linear}


def _softmax_attention(config: ModelConfig, platform: str) -> dict[str, tuple[str, str]]:
    """`training_attention` of the softmax-attention layer kinds."""
    if config.sequence_mesh is not None:  # the kernels attend a sequence to itself; a shard's queries sit at an offset
        n = config.sequence_mesh.shape["sequence"]
        how = "all-gathered keys and values" if config.sequence_attention == "gather" else "a ring of key blocks"
        return {("sliding" if local else "global"): ("xla", f"xla: sequence={n}, {how}")
                for local in layer_kinds_present(config)}
    return {("sliding" if local else "global"): attention_backend(
                config.attention, platform, Features(attention_spec(config, local), config.head_dim, config.dtype,
                                                     config.attention_sinks))
            for local in layer_kinds_present(config)}


def cached_attention(config: ModelConfig, mask: AttentionMask, cache: dict[str, jax.Array] | None = None,
                     cache_index: jax.Array | int = 0, local: bool | jax.Array = False) -> Attend:
    """Grouped-query attention of `T` queries over the decoder's cache layout: the new keys and values are
    written to `cache {"k", "v": [B, S, KVH, hd]}` at slots `cache_index ... cache_index + T - 1` and the queries
    attend to the whole cache under `mask` (its `q_offset` the cache index); without a cache they attend to
    themselves (`S = T`). `local`: the layer's kind (a sliding window), static, or a traced bool inside the scanned
    layer stack (both kinds traced, one run: `lax.cond`). The backend is `attention_backend`'s for
    `config.attention` on JAX's default backend (a cache: XLA); without a cache and with `config.sequence_mesh`, the
    positions are split over its `sequence` axis and `sequence_parallel.sequence_attention` crosses the shards."""
    c = config

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None
               ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        new = cache
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), cache_index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), cache_index, axis=1)
            new = {"k": k, "v": v}  # the cache's dtype: attention's dots cast their operands to the compute dtype

        def kind(is_local: bool) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
            spec = attention_spec(c, is_local)
            if c.sequence_mesh is not None and cache is None:  # positions split over devices: attend across them
                return lambda q, k, v: sequence_attention(
                    q, k, v, mask, spec, c.sequence_mesh, sinks=sinks, query_chunk=c.attention_query_chunk,
                    compute_dtype=c.jnp_dtype, method=c.sequence_attention)
            backend = attention_backend(c.attention, jax.default_backend(),
                                        features_of(spec, q, k, mask, sinks, c.jnp_dtype))[0]
            return lambda q, k, v: attention(q, k, v, mask, spec, sinks=sinks, backend=backend,
                                             query_chunk=c.attention_query_chunk, compute_dtype=c.jnp_dtype)

        if isinstance(local, bool):
            return kind(local)(q, k, v), new
        return jax.lax.cond(local, kind(True), kind(False), q, k, v), new

    return attend
