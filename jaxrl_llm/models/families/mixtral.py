"""Mixtral (8x7B, 8x22B): Mistral's attention (a sliding window on every layer, when set) and, on every layer, a
mixture of `num_local_experts` experts of `intermediate_size` under `block_sparse_moe`, with the top-k weights always
renormalized; its expert matrices are named w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return moe_fields(hf, expert_size_key="intermediate_size", renormalize=True)


def export_keys(c: ModelConfig) -> dict[str, Any]:
    keys = {**moe_keys(c), "sliding_window": c.sliding_window, "router_jitter_noise": 0.0}
    del keys["norm_topk_prob"], keys["num_experts"]
    return keys


def export_problem(c: ModelConfig) -> str | None:
    if not c.norm_topk_prob or c.shared_expert_intermediate_size or c.moe_intermediate_size != c.intermediate_size:
        return "mixtral renormalizes its top-k weights, has no shared expert and its experts are intermediate_size wide"
    return "mixtral has no biases" if c.qkv_bias or c.o_bias else None


_EXPERTS = {("mlp", "experts", ours, "kernel"): f"block_sparse_moe.experts.{{expert}}.{hf}.weight"
            for ours, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}
FAMILY = Family("mixtral", "MixtralForCausalLM", sliding="every", default_rope_theta=1_000_000.0,
                config_fields=config_fields, export_keys=export_keys, export_problem=export_problem, moe=True,
                layer_tensors={("mlp", "router", "kernel"): "block_sparse_moe.gate.weight", **_EXPERTS})
