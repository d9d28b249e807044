"""The Flax modules that hold a decoder layer's weights: `RMSNorm`, `Dense` (a precision-policy matmul, with
unmerged LoRA factors when present), the attention's projections (`Attention`), the gated MLP (`MLP`) and the
mixture of experts (`MoE`, its router and stacked `ExpertWeights`), and a linear-attention layer's
(`LinearAttention`, Qwen3.5's Gated DeltaNet).

Each hands its weights to the block as parts (`Attention.qkv`, `MLP.feed_forward`, `MoE.feed_forward`);
`decoder.py` composes them into layers and runs them through `block.transformer_block`. `make_dense` and
`make_norm` build a `Dense` and an `RMSNorm` with the config's dtypes, initialisation and LoRA settings.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm.models.block import FeedForward, Mixer, gated_mlp
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.gated_delta import (
    LinearState,
    causal_conv,
    chunked_gated_delta_rule,
    gated_rms_norm,
    recurrent_gated_delta_rule,
)
from jaxrl_llm.models.layers import rms_norm
from jaxrl_llm.models.moe import Experts, Routing, experts_dense, experts_parallel, experts_ragged, route
from jaxrl_llm.models.precision import matmul


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, normalised in float32 (as transformers' LlamaRMSNorm);
    `* (1 + scale)` with `unit_offset` (Gemma; the scale then starts at 0)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps, self.dtype, self.unit_offset)


class Dense(nn.Module):
    """`y = x @ kernel (+ bias)` over the last axis, a `precision.matmul` (the precision policy: operands in
    `dtype`, float32 accumulation, output in the activation dtype).

    Same parameters as `flax.linen.Dense` (`kernel [D_in, D_out]`, `bias [D_out]`). Unmerged LoRA factors
    (`lora_a [D_in, r]`, `lora_b [r, D_out]`) add `lora_scale * dropout(x) @ A @ B`, two policy matmuls.
    """

    features: int
    use_bias: bool
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    init_std: float
    lora_scale: float = 0.0
    lora_dropout: float = 0.0
    out_dtype: jnp.dtype | None = None  # None: the activation dtype; float32 for the LM head's logits

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(self.init_std), (x.shape[-1], self.features),
                            self.param_dtype)
        y = matmul(x, kernel, self.dtype, self.out_dtype)
        if self.has_variable("params", "lora_a"):  # unmerged LoRA: + scale * dropout(x) @ A @ B
            inp = x
            if self.lora_dropout > 0 and self.has_rng("dropout"):
                keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.lora_dropout, inp.shape)
                inp = jnp.where(keep, inp / (1.0 - self.lora_dropout), 0.0).astype(x.dtype)
            low_rank = matmul(inp, self.get_variable("params", "lora_a"), self.dtype)
            y = y + self.lora_scale * matmul(low_rank, self.get_variable("params", "lora_b"), self.dtype, y.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(y.dtype)
        return y


def make_dense(config: ModelConfig, features: int, use_bias: bool, name: str,
               out_dtype: jnp.dtype | None = None) -> Dense:
    """A `Dense` of `features` columns in the config's dtypes, initialisation and LoRA settings."""
    return Dense(features, use_bias, config.jnp_dtype, config.jnp_param_dtype, config.initializer_range,
                 config.lora_scale, config.lora_dropout, out_dtype, name=name)


def make_norm(config: ModelConfig, name: str) -> RMSNorm:
    """An `RMSNorm` with the config's epsilon, dtypes and (Gemma) unit offset."""
    return RMSNorm(config.rms_norm_eps, config.jnp_activation_dtype, config.jnp_param_dtype, config.norm_unit_offset,
                   name=name)


class Attention(nn.Module):
    """The attention's weights: q, k, v, o projections (`Dense`), Qwen3 / Gemma 3's q and k norms, and gpt-oss's
    per-head sink logits `sinks [H]`."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.q = make_dense(c, c.num_heads * self.query_width, c.qkv_bias, "q")
        self.k = make_dense(c, c.num_kv_heads * c.head_dim, c.qkv_bias, "k")
        self.v = make_dense(c, c.num_kv_heads * c.head_dim, c.qkv_bias, "v")
        self.o = make_dense(c, c.hidden_size, c.o_bias, "o")
        if c.qk_norm:
            self.q_norm = make_norm(c, "q_norm")
            self.k_norm = make_norm(c, "k_norm")
        if c.attention_sinks:
            self.sinks = self.param("sinks", nn.initializers.normal(c.initializer_range), (c.num_heads,),
                                    c.jnp_param_dtype)

    @property
    def query_width(self) -> int:
        """A head's columns of the q projection: `hd`, or `2 hd` with an output gate (the query, then its gate)."""
        return self.config.head_dim * (2 if self.config.attention_output_gate else 1)

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`x [B, T, D]` -> `q [B, T, H, hd]` (`[B, T, H, 2 hd]` with an output gate), `k, v [B, T, KVH, hd]`."""
        c = self.config
        b, t, _ = x.shape
        return (self.q(x).reshape(b, t, c.num_heads, self.query_width),
                self.k(x).reshape(b, t, c.num_kv_heads, c.head_dim),
                self.v(x).reshape(b, t, c.num_kv_heads, c.head_dim))


class LinearAttention(nn.Module):
    """A Gated DeltaNet layer's weights (Qwen3.5, `models/gated_delta.py`): the input projections `in_qkv [D, 2 Kd +
    Vd]`, `in_z [D, Vd]` (the output gate), `in_b`, `in_a [D, Hv]` (write strength, decay), the convolution `conv/kernel
    [K, 1, 2 Kd + Vd]`, the decay's `A_log` and `dt_bias [Hv]`, the gated norm `norm/scale [dv]` and `out [Vd, D]`.
    `mixer` is the layer's token mixer (`block.LayerOps.mixer`)."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        lin = c.linear
        assert lin is not None
        self.in_qkv = make_dense(c, lin.conv_dim, False, "in_qkv")
        self.in_z = make_dense(c, lin.value_dim, False, "in_z")
        self.in_b = make_dense(c, lin.num_value_heads, False, "in_b")
        self.in_a = make_dense(c, lin.num_value_heads, False, "in_a")
        self.out = make_dense(c, c.hidden_size, False, "out")
        init = nn.initializers.normal(c.initializer_range)
        self.conv = self.param("conv", lambda k, s, t: {"kernel": init(k, s, t)}, (lin.conv_kernel, 1, lin.conv_dim),
                               c.jnp_param_dtype)
        # transformers' init: A uniform in [0.01, 16] (A_log its log), dt_bias 1
        self.A_log = self.param("A_log", lambda k, s, t: jnp.log(jax.random.uniform(k, s, t, 0.01, 16.0)),
                                (lin.num_value_heads,), c.jnp_param_dtype)
        self.dt_bias = self.param("dt_bias", nn.initializers.ones, (lin.num_value_heads,), c.jnp_param_dtype)
        self.norm = self.param("norm", lambda k, s, t: {"scale": jnp.ones(s, t)}, (lin.value_head_dim,),
                               c.jnp_param_dtype)

    def mixer(self, state: LinearState | None, segments: jax.Array | None) -> Mixer:
        """The token mixer over `h [B, T, D]`: `state` the layer's carried `LinearState` (None: sequences that start
        here); `segments [B, T]` the sequences (`gated_delta`), padding (segment 0) zeroed first as transformers
        zeroes it, so a short prompt's convolution window holds zeros, not padding. One new token on a state (a
        decode step) runs the recurrent form, more the chunked one. Returns `(out [B, T, D], the new LinearState)`."""
        c = self.config
        lin = c.linear
        assert lin is not None

        def apply(h: jax.Array) -> tuple[jax.Array, LinearState]:
            b, t, _ = h.shape
            if segments is not None:
                h = jnp.where(segments[..., None] > 0, h, 0).astype(h.dtype)
            mixed, conv = causal_conv(self.in_qkv(h), self.conv["kernel"][:, 0],
                                      None if state is None else state.conv, segments)
            q, k, v = jnp.split(mixed, [lin.key_dim, 2 * lin.key_dim], axis=-1)
            q = q.reshape(b, t, lin.num_key_heads, lin.key_head_dim)
            k = k.reshape(b, t, lin.num_key_heads, lin.key_head_dim)
            v = v.reshape(b, t, lin.num_value_heads, lin.value_head_dim)
            beta = jax.nn.sigmoid(self.in_b(h).astype(jnp.float32))
            g = -jnp.exp(self.A_log.astype(jnp.float32)) * jax.nn.softplus(
                self.in_a(h).astype(jnp.float32) + self.dt_bias.astype(jnp.float32))
            initial = None if state is None else state.recurrent
            if t == 1 and state is not None:
                out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial, segments)
            else:
                out, final = chunked_gated_delta_rule(q, k, v, g, beta, initial, segments, lin.chunk)
            z = self.in_z(h).reshape(b, t, lin.num_value_heads, lin.value_head_dim)
            out = gated_rms_norm(out, self.norm["scale"], z, c.rms_norm_eps)
            return self.out(out.reshape(b, t, lin.value_dim)), LinearState(conv, final)

        return apply


class MLP(nn.Module):
    """The gated MLP's weights, `down(act(gate(x)) * up(x))` (SwiGLU or GeGLU, `config.hidden_act`), of
    `intermediate_size` columns (default: the config's)."""

    config: ModelConfig
    intermediate_size: int | None = None

    def setup(self) -> None:
        c = self.config
        size = self.intermediate_size or c.intermediate_size
        self.gate = make_dense(c, size, c.mlp_bias, "gate")
        self.up = make_dense(c, size, c.mlp_bias, "up")
        self.down = make_dense(c, c.hidden_size, c.mlp_bias, "down")

    def gate_up(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.gate(x), self.up(x)

    def feed_forward(self, replay: jax.Array | None = None, valid: jax.Array | None = None) -> FeedForward:
        return gated_mlp(self.gate_up, self.down, self.config.hidden_act)


class ExpertWeights(nn.Module):
    """The experts' stacked matrices: `gate/kernel, up/kernel [E, D, I]`, `down/kernel [E, I, D]`, and with
    `expert_bias` (gpt-oss) `gate/bias, up/bias [E, I]`, `down/bias [E, D]`."""

    config: ModelConfig

    @nn.compact
    def __call__(self) -> Experts:
        c = self.config
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        init = nn.initializers.normal(c.initializer_range)

        def weights(name: str, shape: tuple[int, ...]) -> dict[str, jax.Array]:
            def make(key: jax.Array, s: tuple[int, ...], t: jnp.dtype) -> dict[str, jax.Array]:
                out = {"kernel": init(key, s, t)}
                if c.expert_bias:
                    out["bias"] = jnp.zeros((s[0], s[-1]), t)
                return out
            return self.param(name, make, shape, c.jnp_param_dtype)

        gate, up, down = weights("gate", (e, d, i)), weights("up", (e, d, i)), weights("down", (e, i, d))
        return Experts(gate["kernel"], up["kernel"], down["kernel"], gate.get("bias"), up.get("bias"),
                       down.get("bias"))


class MoE(nn.Module):
    """A mixture-of-experts feed-forward: `router` (`[D, E]`, float32 logits), the `experts`, and for Qwen2-MoE a
    `shared` gated MLP added behind `sigmoid(x . shared_gate)`. Dropless top-k routing (`moe.route`), experts by
    grouped matmuls (`moe.experts_ragged`; `config.moe_compute = "dense"`: the dense reference)."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.router = make_dense(c, c.num_experts, c.router_bias, "router", jnp.dtype(jnp.float32))
        self.experts = ExpertWeights(c, name="experts")
        if c.shared_expert_intermediate_size:
            self.shared = MLP(c, c.shared_expert_intermediate_size, name="shared")
            self.shared_gate = make_dense(c, 1, False, "shared_gate")

    def feed_forward(self, replay: jax.Array | None = None, valid: jax.Array | None = None) -> FeedForward:
        """`FeedForward` over `h [B, T, D]`; `replay [B, T, k]`: the experts to use (`moe.NO_RECORD` rows: the live
        router's), `valid [B, T]`: the tokens to compute (padding is kept out of the dispatch)."""
        c = self.config

        def apply(h: jax.Array) -> tuple[jax.Array, Routing]:
            b, t, d = h.shape
            logits = self.router(h)  # [B, T, E] float32
            experts, weights = route(logits, c.num_experts_per_tok, renormalize=c.norm_topk_prob, replay=replay)
            compute = experts_dense if c.moe_compute == "dense" else experts_ragged
            if c.expert_mesh is not None and c.moe_compute == "ragged":
                compute = functools.partial(experts_parallel, mesh=c.expert_mesh)
            y = compute(h.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1),
                        self.experts(), hidden_act=c.hidden_act, clamp=c.swiglu_clamp, dtype=c.jnp_dtype,
                        valid=None if valid is None else valid.reshape(-1).astype(bool)).reshape(b, t, d)
            if c.shared_expert_intermediate_size:
                shared, _ = gated_mlp(self.shared.gate_up, self.shared.down, c.hidden_act)(h)
                y = y + jax.nn.sigmoid(self.shared_gate(h).astype(jnp.float32)).astype(y.dtype) * shared
            return y, Routing(experts, logits)

        return apply
