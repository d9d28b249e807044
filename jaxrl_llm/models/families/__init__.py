"""Model families as data: one module per Hugging Face family, each a `Family` that says everything the generic
converter (`models/hf_config.py` for config.json, `models/hf.py` and `hf_export.py` for the tensors) needs to know
about it: its `model_type` and architectures, the activation it accepts, how its attention slides, its RoPE
variants, the `ModelConfig` fields its config.json implies beyond the common reading, the keys it writes back,
what its config cannot express, and its tensor names where they differ from Llama's.

Adding a family: a module here defining `FAMILY`, its name in `FAMILY_MODULES`, and its parity test in
`tests/models/test_families.py` (docs/models.md). A block feature no family has yet also needs its switch in
`ModelConfig` and its math in `models/layers.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig

TensorPath = tuple[str, ...]


def _no_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_keys(config: ModelConfig) -> dict[str, Any]:
    return {}


def _exportable(config: ModelConfig) -> str | None:
    return None


def _no_groups(config: ModelConfig) -> dict[TensorPath, tuple[str, Any]]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face decoder family. Every field but the first two has the Llama behaviour as its default."""

    model_type: str  # config.json's model_type
    architecture: str  # its ...ForCausalLM
    classifier: str | None = None  # its ...ForSequenceClassification, when it loads as a reward model
    hidden_act: str = "silu"  # the one activation it accepts
    hidden_act_key: str = "hidden_act"  # the config.json key holding it (Gemma: hidden_activation)
    # none: no sliding window (use_sliding_window=true refused) | every: every layer slides |
    # pattern: every `sliding_pattern`-th layer is global, the others slide (config.json's layer_types wins)
    sliding: str = "none"
    sliding_pattern: int = 0
    sliding_pattern_key: str | None = None  # the config.json key that may set the pattern (Gemma 3)
    default_rope_theta: float = 10000.0
    local_rope: bool = False  # a second RoPE base on the sliding layers (Gemma 3's rope_local_base_freq)
    partial_rotary: bool = False  # partial_rotary_factor < 1 allowed (Phi-3)
    rope_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # rope_type names it means otherwise
    # ModelConfig fields its config.json implies beyond the common reading (biases, norms, soft caps)
    config_fields: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    export_keys: Callable[[ModelConfig], dict[str, Any]] = _no_keys  # config.json keys only it writes
    export_problem: Callable[[ModelConfig], str | None] = _exportable  # why a config cannot be saved as it
    layer_tensors: Mapping[TensorPath, str] = dataclasses.field(default_factory=dict)  # names unlike Llama's
    # our kernel -> (its fused HF tensor, the part's index in the concatenation) (Phi-3's qkv_proj, gate_up_proj)
    fused_tensors: Mapping[TensorPath, tuple[str, int]] = dataclasses.field(default_factory=dict)
    moe: bool = False  # a mixture of experts on every layer (`moe_fields` reads its config.json keys)
    # our expert parameter -> (the HF tensor holding every expert in our own `[E, ..., out]` layout, part, parts):
    # the tensor's last axis interleaves `parts` parameters, ours at `part::parts` (gpt-oss's gate_up_proj: the gate
    # at 0, up at 1). Experts not listed are one `[out, in]` tensor per expert, as Llama names its MLP.
    stacked_tensors: Mapping[TensorPath, tuple[str, int, int]] = dataclasses.field(default_factory=dict)
    # attention sinks, a biased router, biased experts with the clamped SwiGLU (gpt-oss): a config with any of them
    # exports only as a family that has them
    sinks_and_clamped_experts: bool = False
    # our kernel -> (the HF tensor whose rows interleave several of our kernels by head group, the HF rows of our
    # kernel's columns in order), from the config (Qwen3-Next's in_proj_qkvz and in_proj_ba)
    grouped_tensors: Callable[[ModelConfig], Mapping[TensorPath, tuple[str, Any]]] = _no_groups
    # the model_type of the multimodal checkpoint whose text part this family is (config.json's `text_config`, the
    # weights under `model.language_model.`; the vision tower is left out, as transformers' ...ForCausalLM does)
    multimodal_type: str | None = None


def moe_fields(hf: dict[str, Any], *, expert_size_key: str, renormalize: bool | None = None) -> dict[str, Any]:
    """The `ModelConfig` fields of a mixture-of-experts config.json: the expert count (`num_experts`, or
    `num_local_experts` as Mixtral and transformers 5 write it), top-k, the experts' width (`expert_size_key`), the
    renormalization of the top-k weights (config.json's `norm_topk_prob`, or the family's fixed `renormalize`), the
    shared expert's width and the router's auxiliary-loss coefficient. A config whose layers are not all MoE layers
    (`decoder_sparse_step` > 1, `mlp_only_layers`) is refused: the layer stack is one scanned block."""
    if int(hf.get("decoder_sparse_step") or 1) != 1 or hf.get("mlp_only_layers"):
        raise ConversionError("MoE configs with dense layers between the sparse ones (decoder_sparse_step > 1 or "
                              "mlp_only_layers) are not supported: every layer must be an MoE layer")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts < 1:
        raise ConversionError("an MoE config.json needs num_experts (or num_local_experts) >= 1")
    return {"num_experts": experts, "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf[expert_size_key]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)) if renormalize is None else renormalize,
            "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0)}


def moe_keys(c: ModelConfig) -> dict[str, Any]:
    """config.json keys of an MoE config that transformers 4 and 5 read (`num_experts` and `num_local_experts`)."""
    return {"num_experts": c.num_experts, "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "norm_topk_prob": c.norm_topk_prob,
            "router_aux_loss_coef": c.router_aux_loss_coef, "output_router_logits": False}


FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "qwen3_5_text", "qwen3_moe",
                  "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")
FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (importlib.import_module(f"{__name__}.{name}").FAMILY for name in FAMILY_MODULES)
}
