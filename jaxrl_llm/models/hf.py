"""Hugging Face <-> jaxrl_llm conversion: the only module that knows HF names and layouts.

- `config_from_hf(dict)` -> `ModelConfig`; `config_to_hf(ModelConfig)` -> config.json dict.
- `load_hf_model(dir_or_hub_id)` -> `(ModelConfig, params)`: reads `config.json` and `*.safetensors`
  (single file or sharded with `model.safetensors.index.json`) with safetensors' numpy backend, no torch.
  Tensors are memory-mapped and copied one parameter at a time into its stacked `[L, ...]` array, which is
  moved to the device before the next is built, so host memory stays near one copy of the weights.
- `save_hf_model(params, config, out_dir)` writes config.json, safetensors (sharded above a size
  threshold, with an index) and carries tokenizer files over, so `AutoModelForCausalLM.from_pretrained`
  loads the result.

Every way a model directory can fail to load (a truncated or corrupt safetensors file, a missing shard, a
malformed config.json or index, a tensor whose shape disagrees with config.json) is a `ModelError` (exit 2)
whose one-line message names the file and what to do.

HF linear weights are `[out, in]`; ours are Flax kernels `[in, out]`, stacked over layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl_llm.errors import ConversionError, ModelError, one_line
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import SUPPORTED_ROPE_SCALING, Params, param_shapes
from jaxrl_llm.sharding import param_spec


def _host() -> Any:
    """The host (CPU) device. safetensors' "numpy" framework cannot read bfloat16 (most released checkpoints);
    its "flax" one can, and reading under this default device keeps a shard from passing through an
    accelerator it does not belong to. A function, not a constant: importing this module must not start the
    JAX backend (`jax.distributed.initialize` has to come first in a multi-host run)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: read on the default device (`default_device(None)`)
        return None


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

# Files a model directory may carry besides weights and config; copied verbatim on export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _projection_tensors(block: str, hf_block: str, names: tuple[str, ...]) -> dict[tuple[str, ...], str]:
    """`(block, name, "kernel" | "bias") -> "{hf_block}.{name}_proj.weight" | ".bias"`, the kernels first."""
    return {(block, name, kind): f"{hf_block}.{name}_proj.{'weight' if kind == 'kernel' else 'bias'}"
            for kind in ("kernel", "bias") for name in names}


# Our parameter path (layer params without the leading "layers") -> HF tensor name suffix.
_LAYER_TENSORS = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    **_projection_tensors("attn", "self_attn", ("q", "k", "v", "o")),
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    **_projection_tensors("mlp", "mlp", ("gate", "up", "down")),
}
_GLOBAL_TENSORS = {
    ("embed", "embedding"): "model.embed_tokens.weight",
    ("final_norm", "scale"): "model.norm.weight",
    ("lm_head", "kernel"): "lm_head.weight",
}
# Gemma 2/3 name their four norms differently: post_attention_layernorm is the attention output's norm there.
_GEMMA_LAYER_TENSORS = {
    ("attn_post_norm", "scale"): "post_attention_layernorm.weight",
    ("mlp_norm", "scale"): "pre_feedforward_layernorm.weight",
    ("mlp_post_norm", "scale"): "post_feedforward_layernorm.weight",
}
# Phi-3 fuses q|k|v and gate|up: our kernel -> (HF fused tensor, index of the part in the concatenation).
_FUSED = {
    ("attn", "q", "kernel"): ("self_attn.qkv_proj.weight", 0),
    ("attn", "k", "kernel"): ("self_attn.qkv_proj.weight", 1),
    ("attn", "v", "kernel"): ("self_attn.qkv_proj.weight", 2),
    ("mlp", "gate", "kernel"): ("mlp.gate_up_proj.weight", 0),
    ("mlp", "up", "kernel"): ("mlp.gate_up_proj.weight", 1),
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)



# ----------------------------------------------------------------------------------------------- config


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
    _check_exportable(c)
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


def _check_exportable(config: ModelConfig) -> None:
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


def _tensor_name(path: tuple[str, ...], layer: int | None, model_type: str = "llama") -> str:
    """The HF tensor holding our parameter `path` (of layer `layer`); for Phi-3's fused kernels, the fused one."""
    if path[0] == "layers":
        if model_type == "phi3" and path[1:] in _FUSED:
            return f"model.layers.{layer}.{_FUSED[path[1:]][0]}"
        suffix = _GEMMA_LAYER_TENSORS.get(path[1:]) if model_type in GEMMA_TYPES else None
        return f"model.layers.{layer}.{suffix or _LAYER_TENSORS[path[1:]]}"
    return _GLOBAL_TENSORS[path]


def _fused_rows(path: tuple[str, ...], config: ModelConfig) -> tuple[int, int, int] | None:
    """For a Phi-3 fused kernel: `(first row of our part, its rows, the fused tensor's rows)` in HF's `[out, in]`
    layout (q|k|v: H*hd, KVH*hd, KVH*hd; gate|up: F, F); None for other parameters."""
    if config.model_type != "phi3" or path[0] != "layers" or path[1:] not in _FUSED:
        return None
    hd = config.head_dim
    widths = ((config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd)
              if path[1] == "attn" else (config.intermediate_size,) * 2)
    part = _FUSED[path[1:]][1]
    return sum(widths[:part]), widths[part], sum(widths)


def _is_kernel(path: tuple[str, ...]) -> bool:
    return path[-1] == "kernel"


# --------------------------------------------------------------------------------------------- import


def resolve_model_dir(path_or_id: str | os.PathLike[str]) -> Path:
    """A local directory as is; otherwise a Hugging Face hub id, downloaded (config, safetensors, tokenizer)."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    if path.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") > 1:
        raise ConversionError(f"model directory {path} does not exist (nor is it a hub id)")
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            str(path_or_id),
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
        )
    )


_REDOWNLOAD = "re-download or re-export the model"


def _read_json(file: Path, fix: str) -> Any:
    """`file` parsed as JSON, or a one-line `ModelError` naming it (and the line, for a syntax error) and `fix`."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelError(f"{file}:{e.lineno}: invalid JSON ({e.msg}); {fix}") from e
    except UnicodeDecodeError as e:
        raise ModelError(f"{file}: not UTF-8 text (byte {e.start}); {fix}") from e
    except OSError as e:
        raise ModelError(f"{file} cannot be read ({e.strerror or e}); {fix}") from e


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of `model_dir` as a dict; a `ModelError` naming the file if it is missing or malformed."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file} is missing: a Hugging Face model directory needs config.json")
    hf = _read_json(config_file, f"fix it or {_REDOWNLOAD}")
    if not isinstance(hf, dict):
        raise ModelError(f"{config_file} holds a JSON {type(hf).__name__}, not an object of config keys; "
                         f"fix it or {_REDOWNLOAD}")
    return hf


def _config_from_file(hf: dict[str, Any], config_file: Path) -> ModelConfig:
    """`config_from_hf(hf)` whose errors name `config_file`: a missing key or an unusable value is otherwise a
    bare KeyError / ValueError that says nothing of which file is at fault."""
    try:
        return config_from_hf(hf)
    except ConversionError as e:  # already says what is unsupported; add where it was read
        raise ConversionError(f"{config_file}: {e}") from e
    except KeyError as e:
        raise ModelError(f"{config_file} has no {e.args[0]!r} key, which a Hugging Face config.json needs; "
                         f"fix it or {_REDOWNLOAD}") from e
    except (TypeError, ValueError) as e:
        raise ModelError(f"{config_file} has a value that cannot be used ({one_line(str(e))}); "
                         f"fix it or {_REDOWNLOAD}") from e


def is_classifier(model_dir: Path) -> bool:
    """Whether config.json names a `...ForSequenceClassification` architecture (a reward model)."""
    return any(a in CLASSIFIER_ARCHITECTURES for a in read_hf_config(model_dir).get("architectures") or [])


def read_tensor(path_or_id: str | os.PathLike[str], name: str) -> np.ndarray:
    """One tensor of a checkpoint by its HF name (e.g. a classifier's `score.weight`), as numpy."""
    model_dir = resolve_model_dir(path_or_id)
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(model_dir, stack)
        handle = reader.handle(name)
        with _reading(reader.index[name], name), jax.default_device(_host()):
            return np.asarray(handle.get_tensor(name))


def _unreadable(file: Path, error: BaseException, tensor: str | None = None) -> ModelError:
    """The `ModelError` for a weights file safetensors cannot open (`tensor` None) or read a tensor of."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    what = f"tensor {tensor!r} of {file}" if tensor else str(file)
    return ModelError(f"{what} cannot be read ({one_line(reason)}): the file is truncated or corrupt; "
                      f"{_REDOWNLOAD}")


@contextlib.contextmanager
def _reading(file: Path, tensor: str | None = None) -> Iterator[None]:
    """Turn safetensors' failures on `file` (its `SafetensorError`, an OSError from the file system) into a
    `ModelError` naming the file: otherwise they surface as an "internal error" without a path."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise _unreadable(file, e, tensor) from e


def _open_safetensors(file: Path, framework: str, stack: contextlib.ExitStack) -> Any:
    """`safe_open(file)` entered on `stack`. safetensors checks the header and that the data covers the file
    here, so a truncated or garbage file fails at this point, named."""
    with _reading(file):
        return stack.enter_context(safe_open(file, framework=framework))


def _index_from_json(index_file: Path, model_dir: Path) -> dict[str, Path]:
    """Tensor name -> shard from `model.safetensors.index.json`, every shard it lists checked to exist (a missing
    one would otherwise fail mid-load with a bare "No such file")."""
    index = _read_json(index_file, _REDOWNLOAD)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelError(f'{index_file} has no "weight_map" object of tensor name -> shard file; {_REDOWNLOAD}')
    files = {name: model_dir / file for name, file in weight_map.items()}
    missing = sorted({file for file in files.values() if not file.is_file()})
    if missing:
        also = f" (and {len(missing) - 1} more shard(s))" if len(missing) > 1 else ""
        raise ModelError(f"{missing[0]} is missing{also}: {index_file.name} lists it as a shard of the checkpoint; "
                         "re-download the model with all its shards, or re-export it")
    return files


def _safetensors_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it."""
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        return _index_from_json(index_file, model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(
            f"no *.safetensors in {model_dir}: only safetensors checkpoints are supported "
            "(convert pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    index: dict[str, Path] = {}
    for file in files:
        with contextlib.ExitStack() as stack:
            f = _open_safetensors(file, "numpy", stack)
            index.update({name: file for name in f.keys()})  # noqa: SIM118 - safe_open is not a dict
    return index


def load_hf_model(
    path_or_id: str | os.PathLike[str], *, mesh: Mesh | None = None, **config_overrides: Any
) -> tuple[ModelConfig, Params]:
    """Load a HF causal-LM directory (or hub id) as `(ModelConfig, params)` in `param_dtype`.

    `config_overrides` sets `ModelConfig` fields such as `param_dtype="bfloat16"`, `dtype`, `remat`.
    With a `mesh`, every parameter is created straight into its shards (`jaxrl_llm.sharding` rules): each
    device's slice is read from the safetensors files on its own, so no device (and no host buffer) ever
    holds a full copy of a sharded tensor. Without one, parameters go to the default device.
    Errors name the missing, unexpected or mis-shaped tensor.
    """
    model_dir = resolve_model_dir(path_or_id)
    # The file's config alone first, so its errors name config.json; the caller's overrides are not its fault.
    config = dataclasses.replace(_config_from_file(read_hf_config(model_dir), model_dir / "config.json"),
                                 **config_overrides)
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(model_dir, stack)
        params = _map_with_path(lambda path, spec: reader.param(path, spec, config, mesh), param_shapes(config))
    reader.check_all_used(config)
    return config, params


class _TensorReader:
    """Reads our parameters' blocks from a checkpoint's safetensors files (opened on first use), remembering
    which HF tensors it used; kernels are stored `[out, in]` by HF and `[..., in, out]` by us."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack) -> None:
        self.model_dir, self.stack = model_dir, stack
        self.index = _safetensors_index(model_dir)
        self.handles: dict[Path, Any] = {}
        self.names: dict[Path, set[str]] = {}  # the tensors each opened file really holds
        self.used: set[str] = set()

    def handle(self, name: str) -> Any:
        if name not in self.index:
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        file = self.index[name]
        if file not in self.handles:
            self.handles[file] = _open_safetensors(file, "flax", self.stack)
            with _reading(file):
                self.names[file] = set(self.handles[file].keys())
        if name not in self.names[file]:  # model.safetensors.index.json points at a shard without it
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint: {file} does not hold it, though "
                                  f"model.safetensors.index.json says it does; {_REDOWNLOAD}")
        self.used.add(name)
        return self.handles[file]

    def _slice(self, name: str) -> Any:
        handle = self.handle(name)
        with _reading(self.index[name], name):
            return handle.get_slice(name)

    def check_shape(self, path: tuple[str, ...], name: str, expected_shape: tuple[int, ...],
                    fused: tuple[int, int, int] | None = None) -> None:
        got = tuple(self._slice(name).get_shape())
        want = tuple(expected_shape[::-1] if _is_kernel(path) else expected_shape)
        if fused is not None:
            want = (fused[2], *want[1:])
        if got != want:
            raise ConversionError(
                f"tensor {name!r} has shape {list(got)} in {self.index[name]}, expected {list(want)} from "
                f"{self.model_dir / 'config.json'}: the weights and config.json disagree; {_REDOWNLOAD}"
            )

    def read_block(self, path: tuple[str, ...], name: str, index: tuple[slice, ...], dtype: Any,
                   fused: tuple[int, int, int] | None = None) -> np.ndarray:
        """Our `[..., in, out]` block `index` of HF tensor `name` (of our part's rows, when `fused`)."""
        hf_slice = self._slice(name)
        hf_index = index[::-1] if _is_kernel(path) else index
        if fused is not None:  # shift the out-rows into our part of the fused tensor
            first, rows, _ = fused
            start, stop, _ = hf_index[0].indices(rows)
            hf_index = (slice(first + start, first + stop), *hf_index[1:])
        # The bytes are read here (memory-mapped): an I/O error or an unreadable block must name the file too.
        with _reading(self.index[name], name), jax.default_device(_host()):
            block = np.asarray(hf_slice[hf_index])
        return (block.T if _is_kernel(path) else block).astype(dtype, copy=False)

    def param(self, path: tuple[str, ...], spec: jax.ShapeDtypeStruct, config: ModelConfig,
              mesh: Mesh | None) -> jax.Array:
        """Parameter `path` (stacked `[L, ...]` under `layers`), each device reading only its own block."""
        stacked = path[0] == "layers"
        fused = _fused_rows(path, config)

        def name(layer: int | None) -> str:
            return _tensor_name(path, layer, config.model_type)

        for layer in range(config.num_layers) if stacked else [None]:
            self.check_shape(path, name(layer), spec.shape[1:] if stacked else spec.shape, fused)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
            if not stacked:
                return self.read_block(path, name(None), index, spec.dtype)
            chosen = range(config.num_layers)[index[0]]
            first = self.read_block(path, name(chosen[0]), index[1:], spec.dtype, fused)
            out = np.empty((len(chosen), *first.shape), spec.dtype)  # filled in place: one copy at a time
            out[0] = first
            for j, layer in enumerate(chosen[1:], start=1):
                out[j] = self.read_block(path, name(layer), index[1:], spec.dtype, fused)
            return out

        if mesh is None:
            return jax.device_put(block(()))
        sharding = NamedSharding(mesh, param_spec("/".join(path), spec.shape, mesh))
        return jax.make_array_from_callback(spec.shape, sharding, block)

    def check_all_used(self, config: ModelConfig) -> None:
        """`ConversionError` listing checkpoint tensors no parameter read (other than known, ignorable ones)."""
        ignored = [
            n for n in self.index if n not in self.used
            and (n.endswith(_IGNORED_SUFFIXES) or (n == "lm_head.weight" and config.tie_word_embeddings)
                 or (n.startswith("score.") and is_classifier(self.model_dir)))
        ]
        unexpected = sorted(set(self.index) - self.used - set(ignored))
        if unexpected:
            raise ConversionError(
                f"unexpected tensors in {self.model_dir} for model_type {config.model_type!r}: {unexpected[:5]}"
                + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            )


def _map_with_path(fn: Any, tree: Params, prefix: tuple[str, ...] = ()) -> Params:
    return {
        k: _map_with_path(fn, v, (*prefix, k)) if isinstance(v, dict) else fn((*prefix, k), v)
        for k, v in tree.items()
    }


# --------------------------------------------------------------------------------------------- export


def hf_state_dict(params: Params, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(HF tensor name, numpy array)` one tensor at a time, in HF layouts; Phi-3's q|k|v and gate|up
    are concatenated back into their fused tensors (yielded once all parts are in)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    pending: dict[str, dict[int, np.ndarray]] = {}
    for key_path, leaf in flat:
        path = tuple(k.key for k in key_path)
        array = np.asarray(jax.device_get(leaf))
        fused = _fused_rows(path, config)
        layers = range(config.num_layers) if path[0] == "layers" else [None]
        for layer in layers:
            tensor = array[layer] if layer is not None else array
            tensor = np.ascontiguousarray(tensor.T if _is_kernel(path) else tensor)
            name = _tensor_name(path, layer, config.model_type)
            if fused is None:
                yield name, tensor
                continue
            parts = pending.setdefault(name, {})
            parts[fused[0]] = tensor
            if sum(p.shape[0] for p in parts.values()) == fused[2]:
                yield name, np.concatenate([parts[k] for k in sorted(parts)], axis=0)
                del pending[name]


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask. Linux shows it in /proc/self/status, read without changing it; elsewhere the only
    way is `os.umask`, which sets it process-wide: set to 0 and restored at once (a file another thread
    creates in between would get umask 0, so the window is two calls; the lock keeps two readers apart)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        old = os.umask(0)
        os.umask(old)
    return old


def set_plain_file_mode(path: str | os.PathLike[str]) -> None:
    """Give `path` the mode a plain `open(path, "w")` gives a new file (0o666 less the umask): safetensors'
    `save_file` leaves its file 0600, so nobody else could read an exported model."""
    os.chmod(path, 0o666 & ~_umask())


def _save_safetensors(tensors: dict[str, np.ndarray], file: Path, metadata: dict[str, str]) -> None:
    save_file(tensors, file, metadata=metadata)
    set_plain_file_mode(file)


def _write_safetensors(out: Path, tensors: Any, cast: np.dtype | None, max_shard_bytes: int) -> None:
    """`(name, array)` pairs (cast to `cast`) as `model.safetensors`, or as shards of at most `max_shard_bytes`
    with `model.safetensors.index.json`; earlier weight files in `out` are removed first."""
    shards: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    for name, tensor in tensors:
        if cast is not None:
            tensor = tensor.astype(cast)
        if sizes[-1] and sizes[-1] + tensor.nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += tensor.nbytes
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    metadata = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        _save_safetensors(shards[0], out / "model.safetensors", metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(shard, out / file, metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_model(
    params: Params,
    config: ModelConfig,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Write `params` as a HF directory: config.json, safetensors (sharded above `max_shard_bytes`, with
    `model.safetensors.index.json`), and the tokenizer files found in `tokenizer_dir`.

    `dtype` ("float32" / "bfloat16") casts on the way out; default: the parameters' dtype.
    `extra_tensors` (HF names -> arrays, e.g. a classifier's `score.weight`) are written with the weights and
    `extra_config` updates config.json (e.g. `architectures` of a sequence classifier).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {**config_to_hf(config), **(extra_config or {})}
    cast = np.dtype(jnp.dtype(dtype)) if dtype else None
    if cast is not None:
        hf_config["torch_dtype"] = dtype

    tensors = itertools.chain(hf_state_dict(params, config), (extra_tensors or {}).items())
    _write_safetensors(out, tensors, cast, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))

    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
    return out
