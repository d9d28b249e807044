"""Qwen2 / Qwen2.5: biases on q, k and v (none on o); per-layer sliding windows are refused."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}


def export_problem(c: ModelConfig) -> str | None:
    if c.qkv_bias is False or c.o_bias:
        return "qwen2 has q/k/v biases and no o bias; export this config as 'llama' instead"
    return None


FAMILY = Family("qwen2", "Qwen2ForCausalLM", classifier="Qwen2ForSequenceClassification",
                config_fields=config_fields, export_keys=export_keys, export_problem=export_problem)
