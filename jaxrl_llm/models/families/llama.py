"""Llama (and the many checkpoints that reuse it: SmolLM2, TinyLlama, ...): the reference family."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}


def export_problem(c: ModelConfig) -> str | None:
    return "llama's attention_bias covers q/k/v and o together" if c.qkv_bias != c.o_bias else None


FAMILY = Family("llama", "LlamaForCausalLM", classifier="LlamaForSequenceClassification", export_keys=export_keys,
                export_problem=export_problem)
