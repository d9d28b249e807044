"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, none on o) and, on every layer,
top-k routed experts of `moe_intermediate_size` plus a shared expert of `shared_expert_intermediate_size` that
every token passes through, scaled by `sigmoid(x . shared_expert_gate)`."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": bool(hf.get("qkv_bias", True)), "o_bias": False,
            **moe_fields(hf, expert_size_key="moe_intermediate_size")}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"qkv_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.num_layers, "moe_intermediate_size": c.moe_intermediate_size,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [], **moe_keys(c)}


def export_problem(c: ModelConfig) -> str | None:
    if c.o_bias or not c.qkv_bias:
        return "qwen2_moe has q/k/v biases and no o bias; export this config as 'qwen3_moe' instead"
    return None if c.shared_expert_intermediate_size else "qwen2_moe has a shared expert; export as 'qwen3_moe'"


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", config_fields=config_fields, export_keys=export_keys,
                export_problem=export_problem, moe=True)
