"""The static sampler's model side: the layer stack (`stack.run_layers`, unrolled) driven for generation.

- `decode_layers`: the training forward's layer part (`decoder.flax_layer`) over per-layer caches (the prefill, and
  a reference for the token step);
- `decode_token`: the decode loop's token step: the same stack on prepared `StepWeights` (`step_weights.py`:
  fused q|k|v and gate|up, applied by `step_ops`) over caches in the loop's layout (`loop_cache_attention`), so a
  model family is written once.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models import precision
from jaxrl_llm.models.attention import chunk_allowed
from jaxrl_llm.models.block import Attend, attention_spec
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import (
    Params,
    attention_inputs,
    attention_kind,
    embed,
    final_norm,
    flax_layer,
    unembed,
)
from jaxrl_llm.models.gated_delta import LinearState
from jaxrl_llm.models.layers import head_sinks, masked_softmax, positions_from_mask, rope_parameters, rotary
from jaxrl_llm.models.stack import LayerParts, chosen_experts, layer_weights, run_layers
from jaxrl_llm.models.step_weights import StepWeights, step_ops

# per layer {"k", "v": [B, S, KVH, hd]} (`loop_caches` layout in the loop), a linear-attention layer's `LinearState`
LayerCaches = list[Any]


def split_layers(params: Params, config: ModelConfig) -> list[Params]:
    """The stacked `[L, ...]` layer parameters as `L` per-layer pytrees (static slices, `stack.layer_weights`: a
    hybrid stack's parts are stacked over the layers that have them)."""
    return [layer_weights(config, params["layers"], i) for i in range(config.num_layers)]


def decode_layers(
    params: Params,
    layer_params: list[Params],
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    key_mask: jax.Array,
    caches: LayerCaches,
    cache_index: jax.Array | int,
    return_hidden: bool = False,
) -> tuple[jax.Array, LayerCaches, jax.Array | None]:
    """`tokens [B, T]` at cache slots `cache_index ... cache_index + T - 1` through the Flax layers (`flax_layer`, the
    training forward's part) unrolled over per-layer caches `{"k", "v": [B, S, KVH, hd]}` (`init_caches`), `key_mask
    [B, S]` already marking the new slots valid: `(logits [B, T, V] or final hidden [B, T, D], caches, an MoE model's
    chosen experts [B, T, L, k] int16 or None)`. The prefill is this at `cache_index = 0`.

    The same layers and math as the training forward (a test checks the logits agree), looped differently for the
    sampler (`stack.run_layers` unrolled): inside a `lax.while_loop`, a scan over stacked layers slices every layer's
    weights and cache into temporaries and stacks the updated cache back each step (several copies of the whole cache
    and of the weights per token); with one buffer per layer and per-layer weights sliced once per call, each step
    writes only the new token's keys and values in place: about 2x faster sampling calls on the CPU benchmark model
    (bench/HISTORY.md).
    """
    x = embed(params, config, tokens)
    inputs = attention_inputs(config, positions, key_mask, tokens.shape[1], cache_index)
    segments = jax.lax.dynamic_slice_in_dim(key_mask, cache_index, tokens.shape[1], axis=1).astype(jnp.int32)
    out = run_layers(x, config, flax_layer(config, inputs, cache_index, segments=segments), layer_params, caches)
    hidden = final_norm(params, config, out.x)
    return (hidden if return_hidden else unembed(params, config, hidden)), out.states, chosen_experts(out.routing)


def init_caches(config: ModelConfig, batch: int, length: int) -> LayerCaches:
    """Zero per-layer KV caches `{"k", "v": [batch, length, KVH, hd]}` in the compute dtype (`decode_layers`' layout);
    a linear-attention layer's is its fixed-size `LinearState` (`empty_linear_state`) whatever the length.

    Bytes: `2 * L * batch * length * KVH * hd * itemsize(dtype)` over the softmax layers.
    """
    shape = (batch, length, config.num_kv_heads, config.head_dim)
    empty = {"k": jnp.zeros(shape, config.jnp_dtype), "v": jnp.zeros(shape, config.jnp_dtype)}
    return [empty_linear_state(config, batch) if config.is_linear(i) else empty  # type: ignore[misc]
            for i in range(config.num_layers)]


def empty_linear_state(config: ModelConfig, batch: int) -> LinearState:
    """A linear-attention layer's state at a sequence's start: the convolution's window `[batch, K - 1, 2 Kd + Vd]`
    (activation dtype) and the recurrent state `[batch, Hv, dk, dv]` (float32), zeros. Bytes per sequence:
    `(K - 1) (2 Kd + Vd) itemsize + 4 Hv dk dv`, independent of its length."""
    lin = config.linear
    assert lin is not None
    return LinearState(jnp.zeros((batch, lin.conv_kernel - 1, lin.conv_dim), config.jnp_activation_dtype),
                       jnp.zeros((batch, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim), jnp.float32))


def loop_caches(caches: LayerCaches) -> LayerCaches:
    """Decoder-layout caches `{"k", "v": [B, S, KVH, hd]}` -> the decode loop's layout: keys `[B, KVH, hd, S]`,
    values `[B, KVH, S, hd]`, the layouts the two attention contractions of `decode_token` read."""
    return [{"k": jnp.transpose(c["k"], (0, 2, 3, 1)), "v": jnp.swapaxes(c["v"], 1, 2)} for c in caches]


def decode_token(params: Params, weights: list[StepWeights], config: ModelConfig, tokens: jax.Array,
                 positions: jax.Array, key_mask: jax.Array, caches: LayerCaches, cache_index: jax.Array,
                 shards: int = 1) -> tuple[jax.Array, LayerCaches, jax.Array | None]:
    """One token step of the decode loop: `tokens [B]` at `positions [B]` written to cache slot
    `cache_index`; `key_mask [B, S]` the valid key slots (causality and each layer's sliding window are applied
    here). Returns `(logits [B, V], caches, an MoE model's chosen experts [B, L, k] int16 or None)`.

    The layer stack (`stack.run_layers`, a test checks the logits agree with `decode_layers`) on the sampler's
    prepared weights (`step_ops`: q|k|v and gate|up as one matmul each, laid out for `shards` tensor-parallel shards)
    over the loop's caches (`loop_cache_attention`).
    """
    c = config
    x = embed(params, c, tokens[:, None])  # [B, 1, D]
    inputs = attention_inputs(c, positions[:, None], key_mask, 1, cache_index)  # cos/sin [B, 1, rot]

    def layer(i: int, w: StepWeights, cache: dict[str, jax.Array], _: None) -> LayerParts:
        cos, sin, mask = inputs[attention_kind(c, i)]
        allowed = chunk_allowed(mask, attention_spec(c, c.is_sliding(i)), 0, 1, key_mask.shape[-1])  # [B, 1, S]
        return LayerParts(step_ops(w, c, shards), loop_cache_attention(c, allowed, cache, cache_index), cos, sin)

    out = run_layers(x, c, layer, weights, caches)
    logits = unembed(params, c, final_norm(params, c, out.x[:, 0])).astype(jnp.float32)
    experts = chosen_experts(out.routing)
    return logits, out.states, None if experts is None else experts[:, 0]


def loop_cache_attention(config: ModelConfig, allowed: jax.Array, cache: dict[str, jax.Array],
                         cache_index: jax.Array) -> Attend:
    """Grouped-query attention of one new token per row over the decode loop's caches (`loop_caches`
    layout: keys `[B, KVH, hd, S]`, values `[B, KVH, S, hd]`)::

        K[:, :, :, i] = k;  V[:, :, i] = v     (i = cache_index)
        out = softmax(q . K * scale, allowed) . V

    With this layout `q.K` is a `[groups, hd] x [hd, S]` product per row and head and `p.V` a
    `[groups, S] x [S, hd]` one, both on the cache as stored, so XLA:CPU transposes no cache on any token
    (with `[B, S, KVH, hd]` it re-laid out every layer's whole K and V cache per token: about a quarter of the
    step's op time on the benchmark model; keys `[B, KVH, hd, S]` instead of `[B, KVH, S, hd]`: 1.1x per call,
    bench/HISTORY.md); the new token's keys and values are written in place. `allowed [B, 1, S]`."""
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
        # q [B, 1, H, hd], k and v [B, 1, KVH, hd]
        k_all = jax.lax.dynamic_update_slice_in_dim(cache["k"], k[:, 0, :, :, None].astype(cache["k"].dtype),
                                                    cache_index, 3)
        v_all = jax.lax.dynamic_update_slice_in_dim(cache["v"], v[:, 0, :, None, :].astype(cache["v"].dtype),
                                                    cache_index, 2)
        return loop_layout_attention(q, k_all, v_all, allowed, config, sinks), {"k": k_all, "v": v_all}

    return attend


def loop_layout_attention(q: jax.Array, keys: jax.Array, values: jax.Array, allowed: jax.Array,
                          config: ModelConfig, sinks: jax.Array | None = None) -> jax.Array:
    """`softmax(q . K * scale, allowed) . V` of one query per row: `q [B, 1, H, hd]` over keys `[B, KVH, hd, S]`
    and values `[B, KVH, S, hd]` (the `loop_caches` layout), `allowed [B, 1, S]` -> `[B, 1, H * hd]`; `sinks [H]`:
    gpt-oss's sink logits (`layers.masked_softmax`)."""
    c = config
    b, h, kvh, hd, dtype = q.shape[0], c.num_heads, c.num_kv_heads, c.head_dim, c.jnp_dtype
    scores = precision.einsum("bkgd,bkds->bkgs", q.reshape(b, kvh, h // kvh, hd), keys, dtype, jnp.float32)
    probs = masked_softmax(scores, allowed[:, 0][:, None, None, :], c.attention_scale, c.attn_logit_softcap,
                           head_sinks(sinks, kvh))
    return precision.einsum("bkgs,bksd->bkgd", probs, values, dtype).reshape(b, 1, h * hd)


def longrope_original(config: ModelConfig) -> int | None:
    """The original context of a longrope model (past it the long factors apply), else None."""
    scaling = config.rope_scaling_dict or {}
    return int(scaling["original_max_position_embeddings"]) if scaling.get("rope_type") == "longrope" else None


def longrope_switch(caches: LayerCaches, config: ModelConfig, key_positions: jax.Array) -> LayerCaches:
    """Loop-layout caches whose keys were rotated with longrope's short factors, re-rotated to its long ones.

    When a batch first reaches past the original context, transformers' `generate` recomputes the whole cache
    with the long factors (Phi-3's `prepare_inputs_for_generation`). The keys' rotation can be moved instead:
    rotations about the same planes compose by adding angles, and the attention factor is common to both sets,
    so `k_long = R(p (inv_long - inv_short)) k_short` per key position `p` (`key_positions [B, S]`).
    """
    short, long, _, _ = rope_parameters(config)
    delta = key_positions.astype(jnp.float32)[..., None] * jnp.asarray(long - short)  # [B, S, rot/2]
    emb = jnp.concatenate([delta, delta], axis=-1)
    cos, sin = jnp.cos(emb)[:, None], jnp.sin(emb)[:, None]  # [B, 1, S, rot]
    out = []
    for i, cache in enumerate(caches):
        if config.is_sliding(i) and config.local_rope_theta is not None:  # a local RoPE: never scaled
            out.append(cache)
            continue
        keys = jnp.swapaxes(cache["k"], 2, 3)  # [B, KVH, S, hd]
        rotated = rotary(keys.astype(jnp.float32), cos, sin).astype(cache["k"].dtype)
        out.append({"k": jnp.swapaxes(rotated, 2, 3), "v": cache["v"]})
    return out


def prefill(params: Params, layer_params: list[Params], config: ModelConfig, tokens: jax.Array, mask: jax.Array
            ) -> tuple[jax.Array, LayerCaches, jax.Array | None]:
    """Prompt `[B, P]` -> (next-token logits `[B, V]` float32, per-layer caches `[B, P, KVH, hd]`, an MoE model's
    chosen experts of the prompt `[B, P, L, k]` int16 or None)."""
    caches = init_caches(config, tokens.shape[0], tokens.shape[1])
    # Left padding puts every row's last prompt token in the last column: only it needs logits.
    hidden, caches, experts = decode_layers(params, layer_params, config, tokens, positions_from_mask(mask), mask,
                                            caches, 0, return_hidden=True)
    return unembed(params, config, hidden[:, -1]).astype(jnp.float32), caches, experts
