"""Gemma 3 (text-only `Gemma3ForCausalLM`; the multimodal checkpoint is refused): Gemma 2's block with qk_norm,
five sliding layers of every six (`sliding_window_pattern`), a base RoPE theta of 1e6 and a second one on the
sliding layers (`rope_local_base_freq`)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, gemma2


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {**gemma2.config_fields(hf), "qk_norm": True}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {**gemma2.export_keys(c), "rope_local_base_freq": c.local_rope_theta}


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh",
                hidden_act_key="hidden_activation", sliding="pattern", sliding_pattern=6,
                sliding_pattern_key="sliding_window_pattern", default_rope_theta=1_000_000.0, local_rope=True,
                config_fields=config_fields, export_keys=export_keys, layer_tensors=gemma2.GEMMA_LAYER_TENSORS)
