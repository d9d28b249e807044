"""Qwen3: RMS norms on each head's queries and keys (qk_norm), attention_bias as Llama's."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c.num_layers}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", classifier="Qwen3ForSequenceClassification",
                config_fields=config_fields, export_keys=export_keys)
