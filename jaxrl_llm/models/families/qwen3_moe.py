"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): Qwen3's attention (per-head q/k norms) and, on every layer, a
mixture of `num_experts` experts of `moe_intermediate_size`, top-`num_experts_per_tok` softmax routing, the k weights
renormalized by `norm_topk_prob`; no shared expert."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, **moe_fields(hf, expert_size_key="moe_intermediate_size")}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.num_layers, "moe_intermediate_size": c.moe_intermediate_size,
            "decoder_sparse_step": 1, "mlp_only_layers": [], **moe_keys(c)}


def export_problem(c: ModelConfig) -> str | None:
    return "qwen3_moe has no shared expert; export this config as 'qwen2_moe'" if c.shared_expert_intermediate_size \
        else None


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", config_fields=config_fields, export_keys=export_keys,
                export_problem=export_problem, moe=True)
