"""The decode loop's weights: each layer's parameters prepared once per sampling call (`step_weights`: q|k|v and
gate|up fused into one matrix each, cast to the compute dtype), placed on a mesh (`constrain_step_weights`), and
applied as the block's `LayerOps` (`step_ops`, an MoE layer's feed-forward `step_moe`), which the token step of
`decode.py` and the rollout engine's decode step (`engine/model.py`) run through `block.transformer_block`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models.block import FeedForward, LayerOps, gated_mlp
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.layers import rms_norm
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


def _dense_op(kernel: jax.Array, bias: jax.Array | None, pre_norm: jax.Array | None = None, *, dtype: jnp.dtype,
              dense_matmul: Callable[..., jax.Array] | None) -> Callable[[jax.Array], jax.Array]:
    """`x -> x @ kernel (+ bias)`: a `precision.matmul` with operands in `dtype`, or `dense_matmul(x, kernel)`
    (`dense_matmul(x, kernel, pre_norm)`: the kernel normalizes the rows by the norm's scale `pre_norm` first)."""
    def apply(x: jax.Array) -> jax.Array:
        if dense_matmul is None:
            y = matmul(x, kernel, dtype)
        else:
            y = dense_matmul(x, kernel) if pre_norm is None else dense_matmul(x, kernel, pre_norm)
        return y if bias is None else y + bias

    return apply


def _norm_op(scale: jax.Array | None, config: ModelConfig) -> Callable[[jax.Array], jax.Array] | None:
    """`x -> rms_norm(x) * scale` in the config's convention; None where the layer has no such norm."""
    if scale is None:
        return None
    return lambda x: rms_norm(x, scale, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


def _identity(x: jax.Array) -> jax.Array:
    """A pre-norm the matmul after it applies (`step_ops(norms_in_matmul=True)`)."""
    return x


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
    h, kvh, hd = c.num_heads, c.num_kv_heads, c.head_dim
    dense = functools.partial(_dense_op, dtype=c.jnp_dtype, dense_matmul=dense_matmul)
    norm = functools.partial(_norm_op, config=c)
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

    if w.router is None:
        assert w.down is not None
        feed_forward = gated_mlp(gate_up, dense(w.down, w.down_bias), c.hidden_act, gated)
    else:
        shared = None if w.down is None else gated_mlp(gate_up, dense(w.down, w.down_bias), c.hidden_act, gated)
        # The norm before an MoE layer is XLA's: its router and experts are not the kernel's matmuls.
        feed_forward = step_moe(w, c, shared, norm(w.mlp_norm) if fused else None)
    return LayerOps(attn_norm=_identity if fused else norm(w.attn_norm), qkv=qkv, q_norm=norm(w.q_norm),
                    k_norm=norm(w.k_norm), o=dense(w.o, w.o_bias), attn_post_norm=norm(w.attn_post_norm),
                    mlp_norm=_identity if fused else norm(w.mlp_norm), feed_forward=feed_forward,
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
