"""Hugging Face config.json <-> `ModelConfig`: which families and architectures are supported (and which are
refused, with the reason), the HF keys each family reads and writes, and the checks that make a round trip exact.

- `config_from_hf(dict)` -> `ModelConfig`; `config_to_hf(ModelConfig)` -> config.json dict.

The weights' names and layouts are `jaxrl_llm.models.hf`'s.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import SUPPORTED_ROPE_SCALING

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ARCHITECTURE = dict(zip(SUPPORTED_MODEL_TYPES, SUPPORTED_ARCHITECTURES, strict=True))
# Sequence classifiers (reward models): the same decoder plus a `score` head (see models/reward_model.py).
CLASSIFIER_ARCHITECTURES = tuple(a.replace("ForCausalLM", "ForSequenceClassification")
                                 for a in SUPPORTED_ARCHITECTURES[:4])
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Families refused with a reason beyond "not supported".
_MOE = "mixture-of-experts families (Mixtral, Qwen-MoE, PhiMoE) are out of scope"
_REFUSED = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "phimoe"), _MOE),
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
    act = _hidden_act(hf, str(model_type))
    allowed = ("gelu_pytorch_tanh",) if model_type in GEMMA_TYPES else ("silu",)
    if act not in allowed:
        raise ConversionError(f"unsupported hidden_act {act!r} for {model_type}; supported: {', '.join(allowed)}")
    return str(model_type)


def _hidden_act(hf: dict[str, Any], model_type: str) -> str:
    if model_type in GEMMA_TYPES:  # Gemma's config calls it hidden_activation
        return str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh")
    return str(hf.get("hidden_act", "silu"))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _scaling(scaling: dict[str, Any] | None, hf: dict[str, Any], model_type: str) -> tuple[tuple[str, Any], ...] | None:
    """A `rope_scaling` dict as sorted hashable `(key, value)` pairs (None for the default); the scalings with
    an original context get `original_max_position_embeddings` (Phi-3's top-level value first, as transformers)."""
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if model_type == "phi3" and kind in ("su", "yarn"):  # transformers reads both as longrope for Phi-3
        kind = "longrope"
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


def _rope_settings(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
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
        if model_type == "gemma3_text":
            local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    elif model_type == "gemma3_text":
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    default_theta = 1_000_000.0 if model_type == "gemma3_text" else 10000.0
    rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or default_theta)
    partial = float(hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    if partial != 1.0 and model_type != "phi3":
        raise ConversionError(f"partial_rotary_factor {partial} is supported for phi3 only, not {model_type}")
    return dict(rope_theta=rope_theta, rope_scaling=_scaling(hf.get("rope_scaling") or rope, hf, model_type),
                local_rope_theta=local_theta, partial_rotary_factor=partial)


def _attention_layout(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """`sliding_window` and `layer_types`: Mistral and Phi-3 slide every layer, Gemma 2 every other one
    (layers 0, 2, ...), Gemma 3 five of every six; Qwen's per-layer windows are refused."""
    window = int(hf["sliding_window"]) if hf.get("sliding_window") else None
    if model_type in ("mistral", "phi3"):
        return dict(sliding_window=window, layer_types=None)
    if model_type in GEMMA_TYPES:
        types = hf.get("layer_types")
        if types is None:
            pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        return dict(sliding_window=window, layer_types=tuple(types))
    if hf.get("use_sliding_window"):
        raise ConversionError(
            f"{model_type} with use_sliding_window=True is not supported (per-layer windows); "
            "sliding windows are supported for mistral, phi3, gemma2 and gemma3_text"
        )
    return dict(sliding_window=None, layer_types=None)


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """`ModelConfig` from a config.json dict (transformers 4.x `rope_theta/rope_scaling` or 5.x
    `rope_parameters`). Raises `ConversionError` naming the supported types for anything else."""
    model_type = _check_supported(hf)
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    num_layers = int(hf["num_hidden_layers"])
    attention_bias = bool(hf.get("attention_bias", False))
    gemma = model_type in GEMMA_TYPES
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
        **_rope_settings(hf, model_type),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        **_attention_layout(hf, model_type, num_layers),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        hidden_act=_hidden_act(hf, model_type),
        norm_unit_offset=gemma,
        embed_scale=gemma,
        sandwich_norms=gemma,
        attn_logit_softcap=hf.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 256) if gemma else None,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """config.json dict for `config` (legacy `rope_theta`/`rope_scaling` keys, read by transformers 4 and 5)."""
    c = config
    check_exportable(c)
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURE[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
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
    _add_family_fields(hf, c)
    return hf


def check_exportable(config: ModelConfig) -> None:
    """`ConversionError` unless the model type is exported and its biases are the ones that type's config can say."""
    c = config
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"cannot export model_type {c.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if c.model_type == "qwen2" and (c.qkv_bias is False or c.o_bias):
        raise ConversionError("qwen2 has q/k/v biases and no o bias; export this config as 'llama' instead")
    if c.model_type == "phi3" and (c.qkv_bias or c.o_bias or c.mlp_bias):
        raise ConversionError("phi3 has no biases; export this config as 'llama' instead")
    if c.model_type == "llama" and c.qkv_bias != c.o_bias:
        raise ConversionError("llama's attention_bias covers q/k/v and o together")


def _add_family_fields(hf: dict[str, Any], config: ModelConfig) -> None:
    """The config.json keys only some model types have (added to `hf` in place, after the common ones)."""
    c = config
    if c.model_type in ("llama", "qwen3"):
        hf["attention_bias"] = c.qkv_bias
    if c.model_type == "llama":
        hf["mlp_bias"] = c.mlp_bias
    if c.model_type in ("mistral", "phi3"):
        hf["sliding_window"] = c.sliding_window
    if c.model_type == "phi3":
        hf["partial_rotary_factor"] = c.partial_rotary_factor
        hf["pad_token_id"] = None  # transformers' default (32000) would be out of range for a smaller vocabulary
        scaling = c.rope_scaling_dict or {}
        if "original_max_position_embeddings" in scaling:
            hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    if c.model_type in GEMMA_TYPES:
        hf.pop("hidden_act")
        hf.update(hidden_activation=c.hidden_act, sliding_window=c.sliding_window,
                  layer_types=list(c.layer_types) if c.layer_types else None,
                  query_pre_attn_scalar=_int_if_whole(c.query_pre_attn_scalar),
                  attn_logit_softcapping=c.attn_logit_softcap,
                  final_logit_softcapping=c.final_logit_softcap, attention_bias=c.qkv_bias, pad_token_id=0)
    if c.model_type == "gemma3_text":
        hf["rope_local_base_freq"] = c.local_rope_theta
    if c.model_type in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        hf["max_window_layers"] = c.num_layers


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers' strict config fields want an int where the value is whole (query_pre_attn_scalar)."""
    return int(x) if x is not None and float(x).is_integer() else x
