"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj tensors, partial rotary embeddings, longrope
(transformers reads the `su` and `yarn` rope types as longrope for Phi-3), a sliding window on every layer, no
biases."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family


def export_keys(c: ModelConfig) -> dict[str, Any]:
    keys: dict[str, Any] = {"sliding_window": c.sliding_window, "partial_rotary_factor": c.partial_rotary_factor,
                            # transformers' default pad id (32000) would be out of range for a smaller vocabulary
                            "pad_token_id": None}
    scaling = c.rope_scaling_dict or {}
    if "original_max_position_embeddings" in scaling:
        keys["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    return keys


def export_problem(c: ModelConfig) -> str | None:
    return "phi3 has no biases; export this config as 'llama' instead" if c.qkv_bias or c.o_bias or c.mlp_bias else None


FAMILY = Family(
    "phi3", "Phi3ForCausalLM", sliding="every", partial_rotary=True,
    rope_aliases={"su": "longrope", "yarn": "longrope"}, export_keys=export_keys, export_problem=export_problem,
    fused_tensors={("attn", "q", "kernel"): ("self_attn.qkv_proj.weight", 0),
                   ("attn", "k", "kernel"): ("self_attn.qkv_proj.weight", 1),
                   ("attn", "v", "kernel"): ("self_attn.qkv_proj.weight", 2),
                   ("mlp", "gate", "kernel"): ("mlp.gate_up_proj.weight", 0),
                   ("mlp", "up", "kernel"): ("mlp.gate_up_proj.weight", 1)},
)
