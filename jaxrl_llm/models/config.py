"""`ModelConfig`: the one architecture description the decoder understands.

Hugging Face names never appear outside `models/hf.py`; this dataclass is what the rest of the code sees.
It is frozen and hashable so it can be a static argument of jitted functions.

What some fields mean:

- `rope_scaling` is a tuple of `(key, value)` pairs (hashable; list values as tuples) or None; supported types are
  `linear`, `llama3`, `yarn` and `longrope`.
- `sliding_window` is None (full causal attention) or the window `W`: a query at position `p` sees keys at positions
  `p - W < k <= p` (transformers' convention). `layer_types` (one of "full_attention" / "sliding_attention" per
  layer) limits the window to the sliding layers (Gemma 2 alternates them, Gemma 3 has five local layers per global
  one); None: every layer alike.
- The feed-forward part is the gated MLP (`num_experts = 0`) or, on every layer, a mixture of `num_experts` experts
  of `moe_intermediate_size` with top-`num_experts_per_tok` routing (`models/moe.py`), plus, for Qwen2-MoE, a shared
  expert of `shared_expert_intermediate_size` behind a sigmoid gate.
- gpt-oss adds three switches: `attention_sinks` (a learned logit per head in each softmax's denominator, no value:
  `softmax([scores, sink])` with the sink's column dropped), a biased router and biased experts (`router_bias`,
  `expert_bias`), and `swiglu_clamp = (alpha, limit)`: the experts' activation
  `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`.
- Hybrid stacks (Qwen3.5): `layer_types` may name "linear_attention" layers, Gated DeltaNet (`models/gated_delta.py`)
  of the shape `linear` gives, between softmax-attention ones; `attention_output_gate` gates those layers' output by
  `sigmoid(gate)`, the gate a second half of each query head's projection.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl_llm.models.options import (
    ATTENTION_BACKENDS,
    ATTENTION_REQUESTS,
    SEQUENCE_METHODS,
)
from jaxrl_llm.models.precision import activation_dtype, inference_param_dtype, resolve_compute_dtype

DType = Literal["float32", "bfloat16"]
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """The shape of a Gated DeltaNet layer (Qwen3.5's `linear_*` keys): `num_key_heads` query/key heads of
    `key_head_dim`, `num_value_heads` value heads of `value_head_dim` (a multiple of the key heads), a causal
    convolution of `conv_kernel` taps, and the chunk length of the chunked form (`chunk`)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q | k | v."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a pre-norm decoder: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 (text), and
    the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and gpt-oss (the module docstring says what the
    less obvious fields mean)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False  # Qwen2/2.5 (and Llama's `attention_bias`)
    o_bias: bool = False  # Llama's `attention_bias` also biases o_proj; Qwen2 does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qk_norm_projection: bool = False  # OLMoE: the q and k norms run over the whole projection (H * hd), not per head
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02
    layer_types: tuple[str, ...] | None = None
    # Gemma 3: the sliding layers' RoPE base (unscaled); None: every layer uses rope_theta and rope_scaling.
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0  # Phi-3 family: RoPE rotates the first `factor * head_dim` dims only
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), computed in float32
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size) (in the compute dtype)
    sandwich_norms: bool = False  # Gemma 2/3: RMSNorm also on the attention and MLP outputs, before the residual
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    # Mixture of experts (0 experts: the dense gated MLP). Every layer is an MoE layer; routing is softmax, then top-k,
    # then (norm_topk_prob) the k weights renormalized to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a shared expert, gated by sigmoid(x . w), on every token
    router_bias: bool = False  # gpt-oss: the router's logits have a bias
    expert_bias: bool = False  # gpt-oss: every expert's gate, up and down projections have biases
    swiglu_clamp: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of the experts' clamped SwiGLU
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head joins each softmax's denominator
    attention_output_gate: bool = False  # Qwen3.5: attention output * sigmoid(gate), q_proj holding [q | gate] per head
    linear: LinearAttention | None = None  # the "linear_attention" layers' shape (Qwen3.5)
    router_aux_loss_coef: float = 0.0  # the checkpoint's own coefficient, written back on export (training: rl/sft's)
    # How the experts are computed: "ragged" (sorted by expert, `jax.lax.ragged_dot`) or "dense" (every expert on
    # every token, masked: the tests' reference).
    moe_compute: str = "ragged"
    # The trainer's mesh when its `expert` axis is > 1 (`sharding.expert_mesh`): each MoE layer runs its experts split
    # over that axis (`moe.experts_parallel`). Set by the trainer, never read from a checkpoint; None: one device's
    # computation, which GSPMD partitions like any other op.
    expert_mesh: Mesh | None = None
    # The trainer's mesh when its `sequence` axis is > 1 (`sharding.sequence_mesh`): the full-sequence forward splits
    # each row's positions over that axis and attends across the shards (`models/sequence_parallel.py`), by
    # `sequence_attention` (one of SEQUENCE_METHODS; ring: less memory and time than gather at every size measured,
    # docs/scaling.md). Set by the trainer; None: one device's computation.
    sequence_mesh: Mesh | None = None
    sequence_attention: str = "ring"
    model_type: str = "llama"  # the HF family to export as
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    param_dtype: DType = "float32"
    dtype: DType = "float32"  # compute dtype; softmax and norms still reduce in float32
    remat: bool = False  # rematerialise each layer in the backward pass
    remat_policy: str = "full"  # with remat, what a layer saves: one of REMAT_POLICIES (`decoder.layer_checkpoint`)
    # Layers per iteration of the training forward's layer loop (`lax.scan`); the layer count = a straight-line
    # program: no stacked residual buffers, at the cost of compile time (measured in bench/HISTORY.md)
    scan_unroll: int = 1
    # Full-sequence attention runs over at most this many queries at a time (float32 scores [B, H, chunk, S]
    # instead of [B, H, T, S], recomputed per chunk in the backward); 0 = all queries at once.
    attention_query_chunk: int = 128
    # The full-sequence forward's attention (training, log-prob passes): one of ATTENTION_REQUESTS, or a backend of
    # ATTENTION_BACKENDS; a layer the kernel cannot run (a window, a soft cap, sinks, a cache) runs on XLA.
    attention: str = "auto"
    # LoRA applied unmerged (training with lora.dropout > 0, see jaxrl_llm.models.lora.insert_adapters): a kernel whose
    # module also holds `lora_a` / `lora_b` adds `lora_scale * dropout(x) @ A @ B`, dropout at `lora_dropout`.
    lora_scale: float = 0.0
    lora_dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_compute_dtype(self.dtype))  # `auto`: chosen by the hardware
        check_model_config(self)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def jnp_activation_dtype(self) -> jnp.dtype:
        """Activations and dot outputs (`models/precision.py`): float32 on XLA:CPU, the compute dtype on GPU."""
        return activation_dtype(self.dtype)

    @property
    def jnp_inference_param_dtype(self) -> jnp.dtype:
        """The sampler's and the reference's stored weights (`precision.inference_param_dtype`)."""
        return inference_param_dtype(self.dtype, self.param_dtype)

    @property
    def rope_scaling_dict(self) -> dict[str, float | str] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a linear-attention (Gated DeltaNet) layer."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention: the layer stack's weights then differ between layers."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def layers_holding(self, part: str) -> list[int]:
        """The layers that have weights `part` (`layers/<part>/...` is stacked over these, in order): `attn` the
        softmax-attention layers, `linear_attn` the linear ones, every other part every layer."""
        if part == "attn":
            return [i for i in range(self.num_layers) if not self.is_linear(i)]
        if part == "linear_attn":
            return [i for i in range(self.num_layers) if self.is_linear(i)]
        return list(range(self.num_layers))

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within `sliding_window` (every layer when `layer_types` is None)."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    @property
    def attention_scale(self) -> float:
        """The factor on `q . k`: `1 / sqrt(query_pre_attn_scalar or head_dim)`."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied): `parameter_count(self)`."""
        return parameter_count(self)


def parameter_count(config: ModelConfig) -> int:
    """The parameters of a decoder of `config` (embeddings counted once when tied), from its shapes alone: the
    embedding, every layer's attention and feed-forward (dense MLP or experts, router, shared expert) with their
    biases and norms, the final norm and an untied LM head."""
    c = config
    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d
    attn += (q + 2 * kv) * c.qkv_bias + d * c.o_bias
    attn += ((q + kv) if c.qk_norm_projection else 2 * hd) * c.qk_norm
    attn += c.num_heads * c.attention_sinks + d * q * c.attention_output_gate
    mlp = 3 * d * f + (2 * f + d) * c.mlp_bias
    if c.is_moe:
        shared = c.shared_expert_intermediate_size
        e, i = c.num_experts, c.moe_intermediate_size
        mlp = d * e + 3 * d * i * e + e * c.router_bias + (2 * i + d) * e * c.expert_bias
        mlp += (3 * d * shared + d) if shared else 0
    per_layer = mlp + (4 if c.sandwich_norms else 2) * d
    head = 0 if c.tie_word_embeddings else d * c.vocab_size
    mixers = len(c.layers_holding("attn")) * attn
    if c.linear is not None:
        lin = c.linear
        per_linear = (d * (lin.conv_dim + lin.value_dim + 2 * lin.num_value_heads) + lin.conv_kernel * lin.conv_dim
                      + 2 * lin.num_value_heads + lin.value_head_dim + lin.value_dim * d)
        mixers += len(c.layers_holding("linear_attn")) * per_linear
    return c.vocab_size * d + c.num_layers * per_layer + mixers + d + head


def check_model_config(config: ModelConfig) -> None:
    """`ValueError` on the first field a decoder cannot be built with: layer types of the wrong count or kind, an
    unsupported activation, query heads not a multiple of the KV heads, a dtype other than float32 / bfloat16."""
    c = config
    if c.layer_types is not None:
        if len(c.layer_types) != c.num_layers:
            raise ValueError(f"layer_types has {len(c.layer_types)} entries for {c.num_layers} layers")
        unknown = set(c.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}; supported: {', '.join(LAYER_TYPES)}")
        if c.is_hybrid and c.linear is None:
            raise ValueError("layer_types names linear_attention layers but the config has no `linear` shape")
    if c.linear is not None and c.linear.num_value_heads % c.linear.num_key_heads:
        raise ValueError(f"linear num_value_heads ({c.linear.num_value_heads}) must be a multiple of "
                         f"num_key_heads ({c.linear.num_key_heads})")
    if c.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"unsupported hidden_act {c.hidden_act!r}; supported: silu, gelu_pytorch_tanh")
    if c.num_experts < 0 or (c.num_experts and not 0 < c.num_experts_per_tok <= c.num_experts):
        raise ValueError(f"num_experts_per_tok ({c.num_experts_per_tok}) must be between 1 and num_experts "
                         f"({c.num_experts})")
    if c.num_experts and c.moe_intermediate_size < 1:
        raise ValueError(f"moe_intermediate_size must be >= 1 for {c.num_experts} experts")
    if c.swiglu_clamp is not None and (len(c.swiglu_clamp) != 2 or c.swiglu_clamp[1] <= 0):
        raise ValueError(f"swiglu_clamp must be (alpha, limit) with limit > 0, got {c.swiglu_clamp!r}")
    if c.attention not in ATTENTION_REQUESTS + ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_REQUESTS)}, got {c.attention!r}")
    if c.sequence_attention not in SEQUENCE_METHODS:
        raise ValueError(f"sequence_attention must be one of {', '.join(SEQUENCE_METHODS)}, got "
                         f"{c.sequence_attention!r}")
    if c.moe_compute not in ("ragged", "dense"):
        raise ValueError(f"moe_compute must be 'ragged' or 'dense', got {c.moe_compute!r}")
    if c.num_heads % c.num_kv_heads:
        raise ValueError(f"num_heads ({c.num_heads}) must be a multiple of num_kv_heads ({c.num_kv_heads})")
    for name in ("param_dtype", "dtype"):
        if getattr(c, name) not in ("float32", "bfloat16"):
            raise ValueError(f"{name} must be 'float32' or 'bfloat16', got {getattr(c, name)!r}")
