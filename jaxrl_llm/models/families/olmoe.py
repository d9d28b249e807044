"""OLMoE (OLMoE-1B-7B): Llama-like attention with RMS norms over the whole q and k projections (not per head) and, on
every layer, `num_experts` experts of `intermediate_size`, top-k weights renormalized by `norm_topk_prob`.
`clip_qkv` (clamping q, k, v) is refused."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family, moe_fields, moe_keys


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise ConversionError(f"olmoe with clip_qkv={hf['clip_qkv']} is not supported (only clip_qkv: null)")
    return {"qk_norm": True, "qk_norm_projection": True, **moe_fields(hf, expert_size_key="intermediate_size")}


def export_keys(c: ModelConfig) -> dict[str, Any]:
    keys = {**moe_keys(c), "attention_bias": c.qkv_bias, "clip_qkv": None}
    del keys["num_local_experts"]
    return keys


def export_problem(c: ModelConfig) -> str | None:
    if c.shared_expert_intermediate_size or c.moe_intermediate_size != c.intermediate_size:
        return "olmoe has no shared expert and its experts are intermediate_size wide"
    return None


FAMILY = Family("olmoe", "OlmoeForCausalLM", config_fields=config_fields, export_keys=export_keys,
                export_problem=export_problem, moe=True)
