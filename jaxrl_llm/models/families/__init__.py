"""Model families as data: one module per Hugging Face family, each a `Family` that says everything the generic
converter (`models/hf_config.py` for config.json, `models/hf.py` and `hf_export.py` for the tensors) needs to know
about it: its `model_type` and architectures, the activation it accepts, how its attention slides, its RoPE
variants, the `ModelConfig` fields its config.json implies beyond the common reading, the keys it writes back,
what its config cannot express, and its tensor names where they differ from Llama's.

Adding a family: a module here defining `FAMILY`, its name in `FAMILY_MODULES`, and its parity test in
`tests/test_model_families.py` (docs/models.md). A block feature no family has yet also needs its switch in
`ModelConfig` and its math in `models/layers.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.models.config import ModelConfig

TensorPath = tuple[str, ...]


def _no_fields(hf: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_keys(config: ModelConfig) -> dict[str, Any]:
    return {}


def _exportable(config: ModelConfig) -> str | None:
    return None


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


FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (importlib.import_module(f"{__name__}.{name}").FAMILY for name in FAMILY_MODULES)
}
