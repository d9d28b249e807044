"""Qwen3.5 (text): a hybrid stack, three Gated DeltaNet layers (`linear_attention`) per softmax-attention layer
(`full_attention`, every `full_attention_interval`-th), the softmax layers with per-head q/k norms, a partial rotary
(a quarter of each head by default) and an output gate (`q_proj` holds each head's query and gate), every RMSNorm
`(1 + w)`-scaled as Gemma's, the linear layers' gated norm plain. `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`)
loads, and so does the text part of the multimodal `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`, the
released checkpoints), its vision tower left out as transformers' `Qwen3_5ForCausalLM` leaves it."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import LinearAttention, ModelConfig
from jaxrl_llm.models.families import Family

_LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    linear = LinearAttention(num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                             num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                             key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                             value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                             conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))
    rope = hf.get("rope_parameters") or {}
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.25)
    return {"qk_norm": True, "norm_unit_offset": True, "attention_output_gate": True, "layer_types": tuple(types),
            "linear": linear, "partial_rotary_factor": partial}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    lin = c.linear
    assert lin is not None
    values = (lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, lin.conv_kernel)
    return {"attention_bias": c.qkv_bias, "layer_types": list(c.layer_types or ()),
            "partial_rotary_factor": c.partial_rotary_factor,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor},
            **dict(zip(_LINEAR_KEYS, values, strict=True))}


def export_problem(c: ModelConfig) -> str | None:
    if c.linear is None or not c.attention_output_gate or not c.norm_unit_offset or not c.qk_norm:
        return "qwen3_5_text needs linear-attention layers, the output gate, (1 + w) norms and q/k norms"
    return None


FAMILY = Family(
    "qwen3_5_text", "Qwen3_5ForCausalLM", classifier="Qwen3_5TextForSequenceClassification",
    partial_rotary=True, config_fields=config_fields, export_keys=export_keys, export_problem=export_problem,
    multimodal_type="qwen3_5",
)
