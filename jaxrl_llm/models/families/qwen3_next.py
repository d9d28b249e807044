"""Qwen3-Next: Qwen3.5-MoE's hybrid stack (Gated DeltaNet layers around gated softmax attention, experts with a
shared expert) with the linear layers' input projections fused per key-head group: `in_proj_qkvz` holds, for each
key head, its query, key, values and output gates (`[q | k | v x r | z x r]`, `r` value heads per key head), and
`in_proj_ba` its `[b x r | a x r]`. They are split into our `in_qkv`, `in_z`, `in_b`, `in_a` on import and rejoined
on export (`grouped_tensors`). Top-k renormalisation follows config.json's `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys
from jaxrl_llm.models.families.qwen3_5_text import config_fields as hybrid_fields
from jaxrl_llm.models.families.qwen3_5_text import export_keys as hybrid_keys
from jaxrl_llm.models.families.qwen3_5_text import export_problem as hybrid_problem


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {**hybrid_fields(hf), **moe_fields(hf, expert_size_key="moe_intermediate_size")}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {**hybrid_keys(c), **moe_keys(c), "moe_intermediate_size": c.moe_intermediate_size,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def export_problem(c: ModelConfig) -> str | None:
    if not c.shared_expert_intermediate_size:
        return "qwen3_next has a shared expert on every layer"
    return hybrid_problem(c)


def _rows(widths: list[int], groups: int) -> list[np.ndarray]:
    """Each part's rows in a tensor laid out `[groups, sum(widths)]` (part j at its offset in every group), the
    groups in order."""
    size, offsets = sum(widths), np.cumsum([0, *widths[:-1]])
    return [np.concatenate([g * size + o + np.arange(w) for g in range(groups)]) for o, w in zip(offsets, widths,
                                                                                                    strict=True)]


def grouped_tensors(c: ModelConfig) -> dict[tuple[str, ...], tuple[str, np.ndarray]]:
    lin = c.linear
    assert lin is not None
    hk, dk, dv = lin.num_key_heads, lin.key_head_dim, lin.value_head_dim
    r = lin.num_value_heads // hk
    q, k, v, z = _rows([dk, dk, r * dv, r * dv], hk)
    b, a = _rows([r, r], hk)
    qkvz, ba = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
    return {("linear_attn", "in_qkv", "kernel"): (qkvz, np.concatenate([q, k, v])),
            ("linear_attn", "in_z", "kernel"): (qkvz, z),
            ("linear_attn", "in_b", "kernel"): (ba, b), ("linear_attn", "in_a", "kernel"): (ba, a)}


FAMILY = Family("qwen3_next", "Qwen3NextForCausalLM", partial_rotary=True, config_fields=config_fields,
                export_keys=export_keys, export_problem=export_problem, moe=True, grouped_tensors=grouped_tensors)
