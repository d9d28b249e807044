"""The sampler's model side: the decoder's block (`block.transformer_block`), driven for generation.

- `decode_layers`: the Flax `DecoderLayer` modules with the layer loop unrolled over per-layer caches (the
  prefill, and a reference for the token step);
- `decode_token`: the decode loop's token step: the same block on prepared `StepWeights` (`step_ops`: fused
  q|k|v and gate|up) over caches in the loop's layout (`loop_cache_attention`), so a model family is written
  once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models import precision
from jaxrl_llm.models.block import Attend, FeedForward, LayerOps, gated_mlp, transformer_block
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
from jaxrl_llm.models.moe import (
    Experts,
    FusedExperts,
    Routing,
    experts_dense,
    experts_ragged,
    fuse_experts,
    fused_experts,
    route,
)
from jaxrl_llm.models.precision import matmul
from jaxrl_llm.sharding import constrain

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
        own = (inputs[attention_kind(config, i)],)  # the layer's kind, chosen statically
        x, (cache, routing) = layer.apply({"params": weights}, x, cache, own, cache_index)
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


class StepWeights(NamedTuple):
    """One layer's weights for the decode loop's token step, prepared once per call (outside the loop):
    q|k|v and gate|up concatenated into one matrix each (fewer, wider matmuls), biases and norm scales
    as `[1, N]` rows (absent ones as None); matrices in the compute dtype (the dots' operand dtype, cast once
    per call, outside the loop), biases in the activation dtype. An MoE layer has its `router [D, E]` and
    `experts` (`moe.Experts`) and no dense MLP: `gate_up` and `down` are its shared expert's (Qwen2-MoE, behind
    `shared_gate [D, 1]`) or None; gpt-oss's biased router adds `router_bias [E]` and its attention `sinks [H]`."""

    attn_norm: jax.Array
    qkv: jax.Array
    qkv_bias: jax.Array | None
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    o: jax.Array
    o_bias: jax.Array | None
    attn_post_norm: jax.Array | None
    mlp_norm: jax.Array
    gate_up: jax.Array | None
    gate_up_bias: jax.Array | None
    down: jax.Array | None
    down_bias: jax.Array | None
    mlp_post_norm: jax.Array | None
    router: jax.Array | None = None
    experts: Experts | FusedExperts | None = None
    shared_gate: jax.Array | None = None
    router_bias: jax.Array | None = None
    sinks: jax.Array | None = None


def mlp_width(config: ModelConfig) -> int:
    """The columns of the layer's gate|up halves: the dense MLP's, the shared expert's (Qwen2-MoE), or 0 (none)."""
    return config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size


def fused_step_experts(config: ModelConfig) -> bool:
    """Whether the samplers' steps run an MoE layer's experts as two matmuls over every expert (`moe.fused_experts`)
    instead of the grouped matmul: on the CPU (where `moe.grouped_matmul` is a scan of few-row tiles) when the dense
    compute is at most 4x the routed one (`E <= 4k`), or, in bfloat16 (whose few-row dots XLA:CPU runs slowest), at
    most 16x. A decode step's rows reach most experts (32 rows x top-2 of 8), so both read each expert's weights once;
    measured per MoE layer of 32 rows, D=512 (bench/README.md): 8 experts of 256, top-2, bf16: 0.9 ms fused against
    2.0 ms grouped; 128 of 128, top-8: bf16 11 ms against 50 ms, float32 22 ms against 12 ms (so not in float32)."""
    e, k = config.num_experts, config.num_experts_per_tok
    if not config.is_moe or config.moe_compute != "ragged" or jax.default_backend() != "cpu":
        return False
    return e <= 4 * k or (config.jnp_dtype == jnp.bfloat16 and e <= 16 * k)


def fusable_shards(config: ModelConfig, tensor: int) -> int:
    """How many tensor-parallel shards the fused q|k|v and gate|up matrices are laid out for: `tensor` when
    it divides every fused part's columns, else 1 (plain concatenation)."""
    hd = config.head_dim
    parts = (config.num_heads * hd, config.num_kv_heads * hd, mlp_width(config) or hd)
    return tensor if tensor > 1 and all(n % tensor == 0 for n in parts) else 1


def _fuse(parts: list[jax.Array], shards: int) -> jax.Array:
    """Concatenate `[..., n_i]` arrays on the last axis, shard-major: with `shards = t`, the columns are
    `[p0_0 | p1_0 | ... | p0_1 | p1_1 | ...]` (`p_j` split into `t` equal blocks), so a `tensor`-sharded
    fused matrix gives each device its own block of every part (no resharding in the token step)."""
    if shards == 1:
        return jnp.concatenate(parts, axis=-1)
    blocks = [p.reshape(*p.shape[:-1], shards, p.shape[-1] // shards) for p in parts]
    fused = jnp.concatenate(blocks, axis=-1)
    return fused.reshape(*fused.shape[:-2], -1)


def _unfuse(fused: jax.Array, widths: tuple[int, ...], shards: int) -> list[jax.Array]:
    """Inverse of `_fuse` on the last axis of `fused [..., sum(widths)]`."""
    blocked = fused.reshape(*fused.shape[:-1], shards, -1)
    out, start = [], 0
    for w in widths:
        out.append(blocked[..., start : start + w // shards].reshape(*fused.shape[:-1], w))
        start += w // shards
    return out


def step_weights(layer_params: list[Params], config: ModelConfig, shards: int = 1) -> list[StepWeights]:
    """Per-layer `StepWeights` from `split_layers`' per-layer parameter pytrees, fused for `shards`
    tensor-parallel shards (see `fusable_shards`, `_fuse`)."""
    dtype = config.jnp_dtype

    def cast(a: jax.Array) -> jax.Array:
        return a.astype(dtype)

    def bias(*denses: Params) -> jax.Array | None:
        if "bias" not in denses[0]:
            return None
        return _fuse([d["bias"] for d in denses], shards)[None].astype(config.jnp_activation_dtype)

    out = []
    for w in layer_params:
        attn, mlp = w["attn"], w["mlp"]
        dense = mlp.get("shared", mlp) if config.is_moe else mlp
        has_dense = not config.is_moe or bool(config.shared_expert_intermediate_size)
        moe = {}
        if config.is_moe:
            ex = mlp["experts"]
            biases = [ex[n]["bias"].astype(jnp.float32) if "bias" in ex[n] else None for n in ("gate", "up", "down")]
            stacked = Experts(*(cast(ex[n]["kernel"]) for n in ("gate", "up", "down")), *biases)
            moe = dict(router=cast(mlp["router"]["kernel"]),
                       router_bias=mlp["router"]["bias"].astype(jnp.float32) if "bias" in mlp["router"] else None,
                       experts=fuse_experts(stacked, dtype) if fused_step_experts(config) else stacked,
                       shared_gate=cast(mlp["shared_gate"]["kernel"]) if "shared_gate" in mlp else None)
        out.append(StepWeights(
            attn_norm=w["attn_norm"]["scale"],
            qkv=cast(_fuse([attn["q"]["kernel"], attn["k"]["kernel"], attn["v"]["kernel"]], shards)),
            qkv_bias=bias(attn["q"], attn["k"], attn["v"]),
            q_norm=attn["q_norm"]["scale"] if config.qk_norm else None,
            k_norm=attn["k_norm"]["scale"] if config.qk_norm else None,
            o=cast(attn["o"]["kernel"]),
            o_bias=bias(attn["o"]),
            attn_post_norm=w["attn_post_norm"]["scale"] if config.sandwich_norms else None,
            mlp_norm=w["mlp_norm"]["scale"],
            gate_up=cast(_fuse([dense["gate"]["kernel"], dense["up"]["kernel"]], shards)) if has_dense else None,
            gate_up_bias=bias(dense["gate"], dense["up"]) if has_dense else None,
            down=cast(dense["down"]["kernel"]) if has_dense else None,
            down_bias=bias(dense["down"]) if has_dense else None,
            mlp_post_norm=w["mlp_post_norm"]["scale"] if config.sandwich_norms else None,
            sinks=attn["sinks"].astype(jnp.float32) if config.attention_sinks else None,
            **moe,
        ))
    return out


def loop_caches(caches: LayerCaches) -> LayerCaches:
    """Decoder-layout caches `{"k", "v": [B, S, KVH, hd]}` -> the decode loop's layout: keys `[B, KVH, hd, S]`,
    values `[B, KVH, S, hd]`, the layouts the two attention contractions of `decode_token` read."""
    return [{"k": jnp.transpose(c["k"], (0, 2, 3, 1)), "v": jnp.swapaxes(c["v"], 1, 2)} for c in caches]


def decoder_caches(caches: LayerCaches) -> LayerCaches:
    """Inverse of `loop_caches`."""
    return [{"k": jnp.transpose(c["k"], (0, 3, 1, 2)), "v": jnp.swapaxes(c["v"], 1, 2)} for c in caches]


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
    inputs = attention_inputs(c, positions[:, None], key_mask, 1, cache_index)  # cos/sin [B, 1, rot], [B, 1, S]
    new_caches, routes = [], []
    for i, (w, cache) in enumerate(zip(weights, caches, strict=True)):
        cos, sin, allowed = inputs[attention_kind(c, i)]
        attend = loop_cache_attention(c, allowed, cache, cache_index)
        x, cache, routing = transformer_block(x, step_ops(w, c, shards), attend, cos, sin, c)
        new_caches.append(cache)
        routes.append(routing)
    x = rms_norm(x[:, 0], params["final_norm"]["scale"], c.rms_norm_eps, unit_offset=c.norm_unit_offset)
    experts = stacked_experts(routes)
    return unembed(params, c, x).astype(jnp.float32), new_caches, None if experts is None else experts[:, 0]


def step_ops(w: StepWeights, config: ModelConfig, shards: int = 1,
             dense_matmul: Callable[..., jax.Array] | None = None,
             gated_matmul: Callable[..., jax.Array] | None = None, norms_in_matmul: bool = False) -> LayerOps:
    """`StepWeights` as the block's `LayerOps`: each matmul's operands in the compute dtype, biases added in
    the activation dtype, the fused q|k|v and gate|up outputs split back per shard (`_unfuse`). `dense_matmul(x,
    kernel)`: how a matrix is applied (default `precision.matmul`; the engine's packed CPU kernel).
    `gated_matmul(x, w.gate_up)`: `act(gate) * up` in one op (`LayerOps.gated`; the engine's AMX kernel on a
    gate|up packed for it), used when the MLP has no bias. `norms_in_matmul`: the pre-norms (`attn_norm`,
    `mlp_norm`) are applied by the matmul after them, `dense_matmul(x, kernel, scale)` / `gated_matmul(x, kernel,
    scale)` with the norm's scale (the engine's kernel normalizes its rows as it rounds them), and are the identity
    in the returned ops."""
    c = config
    h, kvh, hd, dtype = c.num_heads, c.num_kv_heads, c.head_dim, c.jnp_dtype

    def dense(kernel: jax.Array, bias: jax.Array | None, pre_norm: jax.Array | None = None
              ) -> Callable[[jax.Array], jax.Array]:
        def apply(x: jax.Array) -> jax.Array:
            if dense_matmul is None:
                y = matmul(x, kernel, dtype)
            else:
                y = dense_matmul(x, kernel) if pre_norm is None else dense_matmul(x, kernel, pre_norm)
            return y if bias is None else y + bias
        return apply

    def norm(scale: jax.Array | None) -> Callable[[jax.Array], jax.Array] | None:
        if scale is None:
            return None
        return lambda x: rms_norm(x, scale, c.rms_norm_eps, unit_offset=c.norm_unit_offset)

    fused = norms_in_matmul and dense_matmul is not None
    attn_scale, mlp_scale = (w.attn_norm, w.mlp_norm) if fused else (None, None)
    if w.router is not None:  # an MoE layer normalizes once, before its router (`step_moe`), not in a matmul
        mlp_scale = None

    def qkv(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, t, _ = x.shape
        q, k, v = _unfuse(dense(w.qkv, w.qkv_bias, attn_scale)(x), (h * hd, kvh * hd, kvh * hd), shards)
        return q.reshape(b, t, h, hd), k.reshape(b, t, kvh, hd), v.reshape(b, t, kvh, hd)

    def gate_up(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        assert w.gate_up is not None
        product = dense(w.gate_up, w.gate_up_bias, mlp_scale)(x)
        gate, up = _unfuse(product, (mlp_width(c), mlp_width(c)), shards)
        return gate, up

    gated = None
    if gated_matmul is not None and w.gate_up_bias is None and w.gate_up is not None:
        def gated(x: jax.Array) -> jax.Array:
            return gated_matmul(x, w.gate_up) if mlp_scale is None else gated_matmul(x, w.gate_up, mlp_scale)

    def identity(x: jax.Array) -> jax.Array:
        return x

    if w.router is None:
        assert w.down is not None
        feed_forward = gated_mlp(gate_up, dense(w.down, w.down_bias), c.hidden_act, gated)
    else:
        shared = None if w.down is None else gated_mlp(gate_up, dense(w.down, w.down_bias), c.hidden_act, gated)
        # The norm before an MoE layer is XLA's: its router and experts are not the kernel's matmuls.
        feed_forward = step_moe(w, c, shared, norm(w.mlp_norm) if fused else None)
    return LayerOps(attn_norm=identity if fused else norm(w.attn_norm), qkv=qkv, q_norm=norm(w.q_norm),
                    k_norm=norm(w.k_norm), o=dense(w.o, w.o_bias), attn_post_norm=norm(w.attn_post_norm),
                    mlp_norm=identity if fused else norm(w.mlp_norm), feed_forward=feed_forward,
                    mlp_post_norm=norm(w.mlp_post_norm), sinks=w.sinks)


def step_moe(w: StepWeights, config: ModelConfig, shared: FeedForward | None,
             pre_norm: Callable[[jax.Array], jax.Array] | None = None, replay: jax.Array | None = None
             ) -> FeedForward:
    """An MoE layer's feed-forward on the sampler's prepared weights: the router's float32 logits, top-k routing
    (`moe.route`; `replay [B, T, k]` forces the experts), the experts by grouped matmuls, plus the gated shared
    expert (`shared`, Qwen2-MoE). `pre_norm`: the layer's `mlp_norm`, when the ops leave it to the feed-forward."""
    c = config
    assert w.router is not None and w.experts is not None

    def apply(h: jax.Array) -> tuple[jax.Array, Routing]:
        if pre_norm is not None:
            h = pre_norm(h)
        b, t, d = h.shape
        logits = matmul(h, w.router, c.jnp_dtype, jnp.float32)
        if w.router_bias is not None:
            logits = logits + w.router_bias
        experts, weights = route(logits, c.num_experts_per_tok, renormalize=c.norm_topk_prob, replay=replay)
        compute = experts_dense if c.moe_compute == "dense" else experts_ragged
        if isinstance(w.experts, FusedExperts):
            compute = functools.partial(fused_experts, num_experts=c.num_experts)
        y = compute(h.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1), w.experts,
                    hidden_act=c.hidden_act, clamp=c.swiglu_clamp, dtype=c.jnp_dtype).reshape(b, t, d)
        if shared is not None and w.shared_gate is not None:
            s, _ = shared(h)
            gate = jax.nn.sigmoid(matmul(h, w.shared_gate, c.jnp_dtype, jnp.float32))
            y = y + gate.astype(y.dtype) * s.astype(y.dtype)
        return y, Routing(experts, logits)

    return apply


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


def constrain_step_weights(w: StepWeights, mesh: Mesh | None) -> StepWeights:
    """Token-step weights gathered over `fsdp` and split over `tensor` (columns of q|k|v and gate|up, rows
    of o and down): each decode step then needs only the tensor-parallel reductions."""
    if mesh is None:
        return w
    columns, rows, whole = PartitionSpec(None, "tensor"), PartitionSpec("tensor", None), PartitionSpec()
    experts: Experts | FusedExperts = Experts(PartitionSpec(None, None, "tensor"), PartitionSpec(None, None, "tensor"),
                                              PartitionSpec(None, "tensor", None), columns, columns, whole)
    if isinstance(w.experts, FusedExperts):  # columns and rows of whole experts per device where `tensor` divides E
        experts = FusedExperts(columns, rows, PartitionSpec("tensor"), whole)
    specs = StepWeights(attn_norm=whole, qkv=columns, qkv_bias=columns, q_norm=whole, k_norm=whole, o=rows,
                        o_bias=whole, attn_post_norm=whole, mlp_norm=whole, gate_up=columns, gate_up_bias=columns,
                        down=rows, down_bias=whole, mlp_post_norm=whole, router=whole, experts=experts,
                        shared_gate=whole, router_bias=whole, sinks=whole)
    return jax.tree.map(lambda x, spec: None if x is None else constrain(x, mesh, spec), w, specs,
                        is_leaf=lambda x: x is None)


# ------------------------------------------------------------------------------------------ host side
