"""The sampler's model side: the decoder's block (`block.transformer_block`), driven for generation.

- `decode_layers`: the Flax `DecoderLayer` modules with the layer loop unrolled over per-layer caches (the
  prefill, and a reference for the token step);
- `decode_token`: the decode loop's token step: the same block on prepared `StepWeights` (`step_weights.py`:
  fused q|k|v and gate|up, applied by `step_ops`) over caches in the loop's layout (`loop_cache_attention`), so a
  model family is written once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import precision
from jaxrl_llm.models.attention import chunk_allowed
from jaxrl_llm.models.block import Attend, attention_spec, transformer_block
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Decoder, DecoderLayer, Params, attention_inputs, attention_kind, unembed
from jaxrl_llm.models.layers import (
    embed_tokens,
    head_sinks,
    masked_softmax,
    positions_from_mask,
    rms_norm,
    rope_parameters,
    rotary,
)
from jaxrl_llm.models.moe import Routing
from jaxrl_llm.models.step_weights import StepWeights, step_ops

LayerCaches = list[dict[str, jax.Array]]  # per layer {"k", "v": [B, S, KVH, hd]} (`loop_caches` layout in the loop)


def split_layers(params: Params, config: ModelConfig) -> list[Params]:
    """The stacked `[L, ...]` layer parameters as `L` per-layer pytrees (static slices)."""
    return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(config.num_layers)]


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
    return_experts: bool = False,
) -> tuple[jax.Array, LayerCaches] | tuple[jax.Array, LayerCaches, jax.Array | None]:
    """`decode_step` with the layer loop unrolled over per-layer caches: `(logits [B, T, V], caches)`, and with
    `return_experts` an MoE model's chosen experts `[B, T, L, k]` int16 (None for a dense model).

    The same modules and math as `Decoder.__call__` (embed -> `DecoderLayer` x L -> final norm -> unembed;
    a test checks the logits agree), driven differently for the sampler's hot loop. Inside a
    `lax.while_loop`, the decoder's `nn.scan` over stacked layers slices every layer's weights and cache
    into temporaries and stacks the updated cache back each step (several copies of the whole cache and of
    the weights per token); with one buffer per layer and per-layer weights sliced once per call, each step
    writes only the new token's keys and values in place: about 2x faster sampling calls on the CPU
    benchmark model (bench/HISTORY.md).
    """
    decoder = Decoder(config)
    x = decoder.apply({"params": params}, tokens, method=lambda m, t: m.embed_tokens(t))
    inputs = attention_inputs(config, positions, key_mask, tokens.shape[1], cache_index)
    layer = DecoderLayer(config)
    new_caches, routes = [], []
    for i, (weights, cache) in enumerate(zip(layer_params, caches, strict=True)):
        kind = attention_kind(config, i)  # the layer's kind, chosen while tracing
        x, (cache, routing) = layer.apply({"params": weights}, x, cache, inputs, cache_index, kind)
        new_caches.append(cache)
        routes.append(routing)
    x = decoder.apply({"params": params}, x, method=lambda m, h: m.final_norm(h))
    out = x if return_hidden else decoder.apply({"params": params}, x, method=lambda m, h: m.unembed(h))
    return (out, new_caches, stacked_experts(routes)) if return_experts else (out, new_caches)


def stacked_experts(routes: list[Routing | None]) -> jax.Array | None:
    """The experts every MoE layer chose, `[..., L, k]` int16 (the record a rollout keeps for routing replay), from
    the layers' `Routing`s (`[..., k]` each); None for a dense model."""
    if not routes or routes[0] is None:
        return None
    return jnp.stack([r.experts for r in routes], axis=-2).astype(jnp.int16)  # type: ignore[union-attr]


def loop_caches(caches: LayerCaches) -> LayerCaches:
    """Decoder-layout caches `{"k", "v": [B, S, KVH, hd]}` -> the decode loop's layout: keys `[B, KVH, hd, S]`,
    values `[B, KVH, S, hd]`, the layouts the two attention contractions of `decode_token` read."""
    return [{"k": jnp.transpose(c["k"], (0, 2, 3, 1)), "v": jnp.swapaxes(c["v"], 1, 2)} for c in caches]


def decode_token(
    params: Params,
    weights: list[StepWeights],
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    key_mask: jax.Array,
    caches: LayerCaches,
    cache_index: jax.Array,
    shards: int = 1,
) -> tuple[jax.Array, LayerCaches]:
    """One token step of the decode loop: `tokens [B]` at `positions [B]` written to cache slot
    `cache_index`; `key_mask [B, S]` the valid key slots (causality and each layer's sliding window are applied
    here). Returns `(logits [B, V], caches)`.

    The decoder's block (`block.transformer_block`, a test checks the logits agree with `decode_layers`), run
    on the sampler's prepared weights (`step_ops`: q|k|v and gate|up as one matmul each, laid out for `shards`
    tensor-parallel shards) over the loop's caches (`loop_cache_attention`).
    """
    logits, caches, _ = decode_token_routed(params, weights, config, tokens, positions, key_mask, caches,
                                            cache_index, shards)
    return logits, caches


def decode_token_routed(params: Params, weights: list[StepWeights], config: ModelConfig, tokens: jax.Array,
                        positions: jax.Array, key_mask: jax.Array, caches: LayerCaches, cache_index: jax.Array,
                        shards: int = 1) -> tuple[jax.Array, LayerCaches, jax.Array | None]:
    """`decode_token` that also returns an MoE model's chosen experts `[B, L, k]` int16 (None for a dense one)."""
    c = config
    x = embed_tokens(params["embed"]["embedding"], tokens[:, None], c)  # [B, 1, D]
    inputs = attention_inputs(c, positions[:, None], key_mask, 1, cache_index)  # cos/sin [B, 1, rot]
    new_caches, routes = [], []
    for i, (w, cache) in enumerate(zip(weights, caches, strict=True)):
        cos, sin, mask = inputs[attention_kind(c, i)]
        allowed = chunk_allowed(mask, attention_spec(c, c.is_sliding(i)), 0, 1, key_mask.shape[-1])  # [B, 1, S]
        attend = loop_cache_attention(c, allowed, cache, cache_index)
        x, cache, routing = transformer_block(x, step_ops(w, c, shards), attend, cos, sin, c)
        new_caches.append(cache)
        routes.append(routing)
    x = rms_norm(x[:, 0], params["final_norm"]["scale"], c.rms_norm_eps, unit_offset=c.norm_unit_offset)
    experts = stacked_experts(routes)
    return unembed(params, c, x).astype(jnp.float32), new_caches, None if experts is None else experts[:, 0]


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


def prefill(
    params: Params, layer_params: list[Params], config: ModelConfig, tokens: jax.Array, mask: jax.Array
) -> tuple[jax.Array, LayerCaches]:
    """Prompt `[B, P]` -> (next-token logits `[B, V]` float32, per-layer caches `[B, P, KVH, hd]`)."""
    logits, caches, _ = prefill_routed(params, layer_params, config, tokens, mask)
    return logits, caches


def prefill_routed(params: Params, layer_params: list[Params], config: ModelConfig, tokens: jax.Array,
                   mask: jax.Array) -> tuple[jax.Array, LayerCaches, jax.Array | None]:
    """`prefill` that also returns an MoE model's chosen experts of the prompt `[B, P, L, k]` int16 (else None)."""
    shape = (tokens.shape[0], tokens.shape[1], config.num_kv_heads, config.head_dim)
    empty = {"k": jnp.zeros(shape, config.jnp_dtype), "v": jnp.zeros(shape, config.jnp_dtype)}
    caches = [empty] * len(layer_params)
    # Left padding puts every row's last prompt token in the last column: only it needs logits.
    hidden, caches, experts = decode_layers(params, layer_params, config, tokens, positions_from_mask(mask), mask,
                                            caches, 0, return_hidden=True, return_experts=True)
    return unembed(params, config, hidden[:, -1]).astype(jnp.float32), caches, experts
