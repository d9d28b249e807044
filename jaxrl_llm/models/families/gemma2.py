"""Gemma 2: GELU (tanh), (1 + w) RMS norms before and after each sublayer ("sandwich"), embeddings scaled by
sqrt(D), soft-capped attention and final logits, queries scaled by query_pre_attn_scalar, tied embeddings, every
other layer sliding (layers 0, 2, ...). `gemma3_text` reads and writes the same keys plus its own."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import Family

# Gemma names its four norms its own way: post_attention_layernorm is the attention output's norm there.
GEMMA_LAYER_TENSORS = {
    ("attn_post_norm", "scale"): "post_attention_layernorm.weight",
    ("mlp_norm", "scale"): "pre_feedforward_layernorm.weight",
    ("mlp_post_norm", "scale"): "post_feedforward_layernorm.weight",
}


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {"tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)), "norm_unit_offset": True,
            "embed_scale": True, "sandwich_norms": True, "attn_logit_softcap": hf.get("attn_logit_softcapping"),
            "final_logit_softcap": hf.get("final_logit_softcapping"),
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256)}


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers' strict config fields want an int where the value is whole (query_pre_attn_scalar)."""
    return int(x) if x is not None and float(x).is_integer() else x


def export_keys(c: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": c.sliding_window, "layer_types": list(c.layer_types) if c.layer_types else None,
            "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar),
            "attn_logit_softcapping": c.attn_logit_softcap, "final_logit_softcapping": c.final_logit_softcap,
            "attention_bias": c.qkv_bias, "pad_token_id": 0}


FAMILY = Family("gemma2", "Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh", hidden_act_key="hidden_activation",
                sliding="pattern", sliding_pattern=2, config_fields=config_fields, export_keys=export_keys,
                layer_tensors=GEMMA_LAYER_TENSORS)
