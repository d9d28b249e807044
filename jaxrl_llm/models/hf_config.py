"""Hugging Face config.json <-> `ModelConfig`, one generic converter driven by the family data of
`jaxrl_llm.models.families` (which families and architectures load, the keys each reads and writes, what its
config cannot express); what is refused beyond "not supported" says why.

- `config_from_hf(dict)` -> `ModelConfig`; `config_to_hf(ModelConfig)` -> config.json dict.

The weights' names and layouts are `jaxrl_llm.models.hf`'s.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import FAMILIES, Family
from jaxrl_llm.models.layers import SUPPORTED_ROPE_SCALING

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())
# Sequence classifiers (reward models): the same decoder plus a `score` head (see models/reward_model.py).
CLASSIFIER_ARCHITECTURES = tuple(f.classifier for f in FAMILIES.values() if f.classifier)
# Families refused with a reason beyond "not supported".
_REFUSED = {
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention is not supported",
    "gemma3": "Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration) is not supported; the text-only "
              "Gemma3ForCausalLM (model_type gemma3_text) is",
}


def _check_supported(hf: dict[str, Any]) -> str:
    """The config's `model_type`, or `ConversionError` naming what is supported (model types, architectures,
    activations)."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        reason = f"{_REFUSED[model_type]}; " if model_type in _REFUSED else ""
        raise ConversionError(
            f"unsupported model_type {model_type!r} (architectures {archs}); {reason}"
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    bad_archs = [a for a in archs if a not in SUPPORTED_ARCHITECTURES + CLASSIFIER_ARCHITECTURES]
    if bad_archs:
        raise ConversionError(
            f"unsupported architecture {bad_archs[0]!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES + CLASSIFIER_ARCHITECTURES)}"
        )
    family = FAMILIES[str(model_type)]
    act = _hidden_act(hf, family)
    if act != family.hidden_act:
        raise ConversionError(f"unsupported hidden_act {act!r} for {model_type}; supported: {family.hidden_act}")
    return str(model_type)


def _hidden_act(hf: dict[str, Any], family: Family) -> str:
    """The activation config.json names (Gemma's key is hidden_activation; hidden_act is read too)."""
    return str(hf.get(family.hidden_act_key) or hf.get("hidden_act") or family.hidden_act)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _scaling(scaling: dict[str, Any] | None, hf: dict[str, Any], family: Family) -> tuple[tuple[str, Any], ...] | None:
    """A `rope_scaling` dict as sorted hashable `(key, value)` pairs (None for the default); the scalings with
    an original context get `original_max_position_embeddings` (Phi-3's top-level value first, as transformers)."""
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    kind = family.rope_aliases.get(kind, kind)
    if kind == "default":
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ConversionError(
            f"unsupported rope_scaling type {kind!r}; supported: default, {', '.join(SUPPORTED_ROPE_SCALING)}"
        )
    params = {k: _hashable(v) for k, v in scaling.items()
              if k not in ("type", "rope_theta", "partial_rotary_factor") and v is not None}
    if kind in ("llama3", "yarn", "longrope"):
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(original or hf.get("max_position_embeddings", 2048))
    return tuple(sorted({**params, "rope_type": kind}.items()))


def _rope_settings(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """`rope_theta`, `rope_scaling`, `local_rope_theta`, `partial_rotary_factor` from transformers 4.x keys
    (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`) or 5.x `rope_parameters` (flat, or nested
    per layer type as Gemma 3 saves it)."""
    rope = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in rope or "sliding_attention" in rope:  # nested per layer type (transformers 5)
        local = dict(rope.get("sliding_attention") or {})
        rope = dict(rope.get("full_attention") or {})
        if local and local.get("rope_type", local.get("type", "default")) != "default":
            raise ConversionError("a scaled RoPE on the sliding layers is not supported (Gemma 3 uses the default)")
        if family.local_rope:
            local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    elif family.local_rope:
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or family.default_rope_theta)
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    if partial != 1.0 and not family.partial_rotary:
        allowed = ", ".join(f.model_type for f in FAMILIES.values() if f.partial_rotary)
        raise ConversionError(f"partial_rotary_factor {partial} is supported for {allowed} only, not "
                              f"{family.model_type}")
    return dict(rope_theta=rope_theta, rope_scaling=_scaling(hf.get("rope_scaling") or rope, hf, family),
                local_rope_theta=local_theta, partial_rotary_factor=partial)


def _attention_layout(hf: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """`sliding_window` and `layer_types` by the family's `sliding`: every layer (Mistral, Phi-3), a pattern of
    sliding and global layers (Gemma 2 every other one, Gemma 3 five of every six; config.json's layer_types wins),
    or none (a config asking for per-layer windows is refused)."""
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    if family.sliding == "every":
        return dict(sliding_window=window, layer_types=None)
    if family.sliding == "pattern":
        types = hf.get("layer_types")
        if types is None:
            key = family.sliding_pattern_key
            pattern = int((hf.get(key) if key else None) or family.sliding_pattern)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        return dict(sliding_window=window, layer_types=tuple(types))
    if hf.get("use_sliding_window"):
        sliding = ", ".join(f.model_type for f in FAMILIES.values() if f.sliding != "none")
        raise ConversionError(
            f"{family.model_type} with use_sliding_window=True is not supported (per-layer windows); "
            f"sliding windows are supported for {sliding}"
        )
    return dict(sliding_window=None, layer_types=None)


def text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json whose text part a family is (`Family.multimodal_type`: Qwen3.5's) as that family's
    config (its `text_config`, with the family's model_type and architecture); any other config as it is."""
    text = next((f for f in FAMILIES.values() if f.multimodal_type and f.multimodal_type == hf.get("model_type")), None)
    if text is None or not isinstance(hf.get("text_config"), dict):
        return hf
    tied = hf.get("tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", False))
    return {**hf["text_config"], "model_type": text.model_type, "architectures": [text.architecture],
            "tie_word_embeddings": tied}


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a config.json dict (transformers 4.x `rope_theta/rope_scaling` or 5.x
    `rope_parameters`; a multimodal checkpoint's text part, `text_part`). Raises `ConversionError` naming the supported
    types for anything else."""
    hf = text_part(hf)
    model_type = _check_supported(hf)
    family = FAMILIES[model_type]
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    num_layers = int(hf["num_hidden_layers"])
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    fields: dict[str, Any] = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **_rope_settings(hf, family),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_attention_layout(hf, family, num_layers),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        hidden_act=_hidden_act(hf, family),
    )
    fields.update(family.config_fields(hf))  # what this family's config.json implies beyond the common reading
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """config.json dict for `config` (legacy `rope_theta`/`rope_scaling` keys, read by transformers 4 and 5)."""
    c = config
    family = check_exportable(c)
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        family.hidden_act_key: c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else {k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in c.rope_scaling},
        "tie_word_embeddings": c.tie_word_embeddings,
        "initializer_range": c.initializer_range,
        "torch_dtype": c.param_dtype,
        "use_cache": True,
    }
    if c.bos_token_id is not None:
        hf["bos_token_id"] = c.bos_token_id
    if c.eos_token_id is not None:
        eos = c.eos_token_id
        hf["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    hf.update(family.export_keys(c))
    return hf


def check_exportable(config: ModelConfig) -> Family:
    """The family `config` is exported as; `ConversionError` unless it is one and its config can say this one's
    settings (biases a family's config.json has no key for)."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ConversionError(f"cannot export model_type {config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if family.moe != config.is_moe:
        kind = "a mixture of experts" if config.is_moe else "a dense model"
        fit = [f.model_type for f in FAMILIES.values() if f.moe == config.is_moe]
        raise ConversionError(f"cannot export {kind} as {config.model_type!r}; export it as one of {fit}")
    oss = config.attention_sinks or config.router_bias or config.expert_bias or config.swiglu_clamp is not None
    if oss and not family.sinks_and_clamped_experts:
        fit = [f.model_type for f in FAMILIES.values() if f.sinks_and_clamped_experts]
        raise ConversionError(f"cannot export as {config.model_type!r}: it has no attention sinks, router or expert "
                              f"biases or clamped SwiGLU; export it as one of {fit}")
    problem = family.export_problem(config)
    if problem:
        raise ConversionError(problem)
    return family
