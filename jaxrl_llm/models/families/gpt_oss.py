"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with q/k/v/o biases and a learned sink logit per head, sliding-window
layers alternating with global ones (layer 0 slides), YaRN RoPE, and on every layer a mixture of `num_local_experts`
experts of `intermediate_size` behind a biased router (top-k of the logits, softmax over those k: the renormalized
top-k of the softmax). Its experts have biases and a clamped SwiGLU, `(clip(up, -l, l) + 1) * g * sigmoid(1.702 g)`
with `g = min(gate, l)`, `l = swiglu_limit`; their matrices are stored for all experts at once in our `[E, in, out]`
layout, gate and up interleaved in `gate_up_proj` (columns 0, 2, 4, ... the gate). The released MXFP4 checkpoints
are refused (a bfloat16 one loads)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys

# transformers' GptOssConfig default when config.json names no RoPE scaling
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise ConversionError(f"gpt_oss quantized with {method!r} is not supported: load a bfloat16 checkpoint, or "
                              "dequantize it with transformers (Mxfp4Config(dequantize=True)) and save_pretrained")
    bias = bool(hf.get("attention_bias", True))
    fields = {"qkv_bias": bias, "o_bias": bias, "attention_sinks": True, "router_bias": True, "expert_bias": True,
              "swiglu_clamp": (float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))),
              **moe_fields(hf, expert_size_key="intermediate_size", renormalize=True)}
    if not (hf.get("rope_scaling") or hf.get("rope_parameters")):
        fields["rope_scaling"] = tuple(sorted(_DEFAULT_YARN.items()))
    return fields


def export_keys(c: ModelConfig) -> dict[str, Any]:
    keys = {**moe_keys(c), "attention_bias": c.qkv_bias, "sliding_window": c.sliding_window,
            "layer_types": list(c.layer_types) if c.layer_types else None,
            "swiglu_alpha": c.swiglu_clamp[0] if c.swiglu_clamp else 1.702,
            "swiglu_limit": c.swiglu_clamp[1] if c.swiglu_clamp else 7.0}
    del keys["norm_topk_prob"], keys["num_experts"]
    return keys


def export_problem(c: ModelConfig) -> str | None:
    if not (c.attention_sinks and c.router_bias and c.expert_bias and c.swiglu_clamp is not None):
        return "gpt_oss has attention sinks, a biased router, biased experts and a clamped SwiGLU"
    if not c.norm_topk_prob or c.shared_expert_intermediate_size or c.moe_intermediate_size != c.intermediate_size:
        return "gpt_oss renormalizes its top-k weights, has no shared expert and its experts are intermediate_size wide"
    return None if c.qkv_bias == c.o_bias else "gpt_oss's attention_bias biases q, k, v and o alike"


_EXPERTS = {("mlp", "experts", ours, kind): (f"mlp.experts.{hf}{'' if kind == 'kernel' else '_bias'}", part, parts)
            for ours, hf, part, parts in (("gate", "gate_up_proj", 0, 2), ("up", "gate_up_proj", 1, 2),
                                          ("down", "down_proj", 0, 1))
            for kind in ("kernel", "bias")}
FAMILY = Family("gpt_oss", "GptOssForCausalLM", sliding="pattern", sliding_pattern=2, default_rope_theta=150000.0,
                config_fields=config_fields, export_keys=export_keys, export_problem=export_problem, moe=True,
                layer_tensors={("mlp", "router", "kernel"): "mlp.router.weight",
                               ("mlp", "router", "bias"): "mlp.router.bias", ("attn", "sinks"): "self_attn.sinks"},
                stacked_tensors=_EXPERTS, sinks_and_clamped_experts=True)
