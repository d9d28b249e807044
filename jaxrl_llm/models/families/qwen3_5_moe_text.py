"""Qwen3.5-MoE (text): Qwen3.5's hybrid stack (`qwen3_5_text`) with a mixture of experts on every layer: top-k
routing with the k weights always renormalised, and a shared expert behind `sigmoid(x . shared_expert_gate)`
(Qwen2-MoE's). `Qwen3_5MoeForCausalLM` (model_type `qwen3_5_moe_text`) loads, and so does the text part of the
multimodal checkpoint (model_type `qwen3_5_moe`)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys
from jaxrl_llm.models.families.qwen3_5_text import config_fields as hybrid_fields
from jaxrl_llm.models.families.qwen3_5_text import export_keys as hybrid_keys
from jaxrl_llm.models.families.qwen3_5_text import export_problem as hybrid_problem


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {**hybrid_fields(hf), **moe_fields(hf, expert_size_key="moe_intermediate_size", renormalize=True)}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {**hybrid_keys(c), **moe_keys(c), "moe_intermediate_size": c.moe_intermediate_size,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size}


def export_problem(c: ModelConfig) -> str | None:
    if not c.norm_topk_prob or not c.shared_expert_intermediate_size:
        return "qwen3_5_moe_text always renormalises its top-k weights and has a shared expert"
    return hybrid_problem(c)


FAMILY = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", partial_rotary=True, config_fields=config_fields,
                export_keys=export_keys, export_problem=export_problem, moe=True,
                multimodal_type="qwen3_5_moe")
