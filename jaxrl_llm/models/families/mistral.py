"""Mistral: Llama with a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": c.sliding_window}


FAMILY = Family("mistral", "MistralForCausalLM", classifier="MistralForSequenceClassification", sliding="every",
                export_keys=export_keys)
