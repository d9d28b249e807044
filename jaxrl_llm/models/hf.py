"""Hugging Face <-> jaxrl_llm weights: the HF tensor names and layouts, and reading and writing model directories
(config.json <-> `ModelConfig` is `jaxrl_llm.models.hf_config`'s; its names are re-exported here).
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
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import SafetensorError, safe_open

from jaxrl_llm.errors import ConversionError, ModelError, one_line
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, param_shapes
from jaxrl_llm.models.families import FAMILIES
from jaxrl_llm.models.hf_config import CLASSIFIER_ARCHITECTURES, config_from_hf
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



def _projection_tensors(block: str, hf_block: str, names: tuple[str, ...]) -> dict[tuple[str, ...], str]:
    """`(block, name, "kernel" | "bias") -> "{hf_block}.{name}_proj.weight" | ".bias"`, the kernels first."""
    return {(block, name, kind): f"{hf_block}.{name}_proj.{'weight' if kind == 'kernel' else 'bias'}"
            for kind in ("kernel", "bias") for name in names}


_MLP = ("gate", "up", "down")
# Our parameter path (layer params without the leading "layers") -> HF tensor name suffix.
_LAYER_TENSORS = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    **_projection_tensors("attn", "self_attn", ("q", "k", "v", "o")),
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    **_projection_tensors("mlp", "mlp", ("gate", "up", "down")),
    # A mixture of experts (Qwen-MoE, OLMoE): the router, every expert's projections (stacked `[E, ...]` by us, one
    # tensor per expert in HF), Qwen2-MoE's shared expert and its gate.
    ("mlp", "router", "kernel"): "mlp.gate.weight",
    **{("mlp", "experts", name, "kernel"): f"mlp.experts.{{expert}}.{name}_proj.weight" for name in _MLP},
    **{("mlp", "shared", name, "kernel"): f"mlp.shared_expert.{name}_proj.weight" for name in _MLP},
    ("mlp", "shared_gate", "kernel"): "mlp.shared_expert_gate.weight",
    # Gated DeltaNet (Qwen3.5's linear-attention layers)
    **{("linear_attn", ours, "kernel"): f"linear_attn.{theirs}.weight" for ours, theirs in (
        ("in_qkv", "in_proj_qkv"), ("in_z", "in_proj_z"), ("in_b", "in_proj_b"), ("in_a", "in_proj_a"),
        ("out", "out_proj"), ("conv", "conv1d"))},
    ("linear_attn", "A_log"): "linear_attn.A_log",
    ("linear_attn", "dt_bias"): "linear_attn.dt_bias",
    ("linear_attn", "norm", "scale"): "linear_attn.norm.weight",
}
_GLOBAL_TENSORS = {
    ("embed", "embedding"): "model.embed_tokens.weight",
    ("final_norm", "scale"): "model.norm.weight",
    ("lm_head", "kernel"): "lm_head.weight",
}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Parts of released checkpoints that transformers' causal-LM classes leave out too: Qwen3.5's and Qwen3-Next's
# multi-token-prediction head, a multimodal checkpoint's vision tower.
_IGNORED_PREFIXES = ("mtp.", "model.visual.")
_LANGUAGE_MODEL = "model.language_model."  # where a multimodal checkpoint keeps its decoder


def _text_name(name: str) -> str:
    """A multimodal checkpoint's tensor name as the text-only decoder's (`model.language_model.x` -> `model.x`)."""
    return "model." + name.removeprefix(_LANGUAGE_MODEL) if name.startswith(_LANGUAGE_MODEL) else name



# ----------------------------------------------------------------------------------------------- config


def _stacked(path: tuple[str, ...], model_type: str) -> tuple[str, int, int] | None:
    """`(HF tensor, part, parts)` when the family stores parameter `path` for all experts in one tensor in our layout,
    interleaved on its last axis (`Family.stacked_tensors`, gpt-oss); None otherwise."""
    return FAMILIES[model_type].stacked_tensors.get(path[1:]) if path[0] == "layers" else None


def _tensor_name(path: tuple[str, ...], layer: int | None, model_type: str = "llama", expert: int | None = None) -> str:
    """The HF tensor holding our parameter `path` (of layer `layer`, and of expert `expert` for an expert's
    matrix): Llama's name unless the family names it its own way (`Family.layer_tensors`); for a fused kernel
    (`Family.fused_tensors`, Phi-3), the fused one; for experts stored together (`Family.stacked_tensors`), theirs."""
    if path[0] == "layers":
        family = FAMILIES[model_type]
        if path[1:] in family.stacked_tensors:
            return f"model.layers.{layer}.{family.stacked_tensors[path[1:]][0]}"
        if path[1:] in family.fused_tensors:
            return f"model.layers.{layer}.{family.fused_tensors[path[1:]][0]}"
        name = family.layer_tensors.get(path[1:]) or _LAYER_TENSORS[path[1:]]
        return f"model.layers.{layer}.{name.format(expert=expert)}"
    return _GLOBAL_TENSORS[path]


def _per_expert(path: tuple[str, ...]) -> bool:
    """Whether parameter `path` is stacked over experts after its layers (`[L, E, ...]`, one HF tensor per expert)."""
    return len(path) > 2 and path[0] == "layers" and path[2] == "experts"


def _fused_rows(path: tuple[str, ...], config: ModelConfig) -> tuple[int, int, int] | None:
    """For a fused kernel (Phi-3's): `(first row of our part, its rows, the fused tensor's rows)` in HF's `[out, in]`
    layout (q|k|v: H*hd, KVH*hd, KVH*hd; gate|up: F, F); None for other parameters."""
    fused = FAMILIES[config.model_type].fused_tensors
    if path[0] != "layers" or path[1:] not in fused:
        return None
    hd = config.head_dim
    widths = ((config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd)
              if path[1] == "attn" else (config.intermediate_size,) * 2)
    part = fused[path[1:]][1]
    return sum(widths[:part]), widths[part], sum(widths)


def _grouped_rows(path: tuple[str, ...], config: ModelConfig) -> tuple[str, np.ndarray] | None:
    """For a kernel whose HF tensor interleaves several of ours by head group (`Family.grouped_tensors`, Qwen3-Next):
    `(that tensor's name suffix, the HF rows of our kernel's columns)`; None for other parameters."""
    if path[0] != "layers":
        return None
    return FAMILIES[config.model_type].grouped_tensors(config).get(path[1:])


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
            return np.asarray(handle.get_tensor(reader.stored[name]))


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
        # A multimodal checkpoint's text part (Qwen3.5's) keeps the decoder under `model.language_model.`: our names
        # are read there, as transformers' text-only class reads them (`stored`: our name -> the file's).
        self.stored = {name: name for name in self.index}
        if _LANGUAGE_MODEL + "embed_tokens.weight" in self.index and "model.embed_tokens.weight" not in self.index:
            self.stored = {_text_name(name): name for name in self.index}
            self.index = {_text_name(name): file for name, file in self.index.items()}
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
        if self.stored[name] not in self.names[file]:  # model.safetensors.index.json points at a shard without it
            raise ConversionError(f"tensor {name!r} is missing from the checkpoint: {file} does not hold it, though "
                                  f"model.safetensors.index.json says it does; {_REDOWNLOAD}")
        self.used.add(name)
        return self.handles[file]

    def _slice(self, name: str) -> Any:
        handle = self.handle(name)
        with _reading(self.index[name], name):
            return handle.get_slice(self.stored[name])

    def check_shape(self, path: tuple[str, ...], name: str, expected_shape: tuple[int, ...],
                    fused: tuple[int, int, int] | None = None, stacked: tuple[str, int, int] | None = None) -> None:
        got = tuple(self._slice(name).get_shape())
        want = tuple(expected_shape[::-1] if _is_kernel(path) and stacked is None else expected_shape)
        if fused is not None:
            want = (fused[2], *want[1:])
        if stacked is not None:
            want = (*want[:-1], want[-1] * stacked[2])
        if got != want:
            raise ConversionError(
                f"tensor {name!r} has shape {list(got)} in {self.index[name]}, expected {list(want)} from "
                f"{self.model_dir / 'config.json'}: the weights and config.json disagree; {_REDOWNLOAD}"
            )

    def read_block(self, path: tuple[str, ...], name: str, index: tuple[slice, ...], dtype: Any,
                   fused: tuple[int, int, int] | None = None, stacked: tuple[str, int, int] | None = None
                   ) -> np.ndarray:
        """Our `[..., in, out]` block `index` of HF tensor `name` (of our part's rows, when `fused`; of our part of
        the interleaved last axis, when `stacked`)."""
        hf_slice = self._slice(name)
        if stacked is not None:  # our layout already; the last axis interleaves `parts` parameters
            _, part, parts = stacked
            start, stop, _ = index[-1].indices(hf_slice.get_shape()[-1] // parts)
            with _reading(self.index[name], name), jax.default_device(_host()):
                block = np.asarray(hf_slice[(*index[:-1], slice(start * parts, stop * parts))])
            return block[..., part::parts].astype(dtype)
        hf_index = index[::-1] if _is_kernel(path) else index
        if fused is not None:  # shift the out-rows into our part of the fused tensor
            first, rows, _ = fused
            start, stop, _ = hf_index[0].indices(rows)
            hf_index = (slice(first + start, first + stop), *hf_index[1:])
        # The bytes are read here (memory-mapped): an I/O error or an unreadable block must name the file too.
        with _reading(self.index[name], name), jax.default_device(_host()):
            block = np.asarray(hf_slice[hf_index])
        return (block.T if _is_kernel(path) else block).astype(dtype, copy=False)

    def check_grouped(self, name: str, expected_shape: tuple[int, ...], rows: np.ndarray) -> None:
        """A grouped HF tensor `[rows, in]` holds our kernel `[in, len(rows)]`'s columns at `rows`."""
        got = tuple(self._slice(name).get_shape())
        if len(got) != 2 or got[1] != expected_shape[0] or got[0] <= int(rows.max()):
            raise ConversionError(
                f"tensor {name!r} has shape {list(got)} in {self.index[name]}, which cannot hold {len(rows)} rows of "
                f"width {expected_shape[0]} as {self.model_dir / 'config.json'} lays them out; {_REDOWNLOAD}")

    def read_grouped(self, name: str, index: tuple[slice, ...], rows: np.ndarray, dtype: Any) -> np.ndarray:
        """Our `[in, out]` block `index` of a kernel whose columns are rows `rows` of HF tensor `name`."""
        handle = self.handle(name)
        with _reading(self.index[name], name), jax.default_device(_host()):
            tensor = np.asarray(handle.get_tensor(self.stored[name]))
        return tensor[rows[index[1]]][:, index[0]].T.astype(dtype, copy=False)

    def param(self, path: tuple[str, ...], spec: jax.ShapeDtypeStruct, config: ModelConfig,
              mesh: Mesh | None) -> jax.Array:
        """Parameter `path` (stacked `[L, ...]` under `layers`, over the layers that have it in a hybrid stack;
        `[L, E, ...]` for the experts' matrices), each device reading only its own block."""
        stacked = path[0] == "layers"
        together = _stacked(path, config.model_type)  # every expert in one HF tensor (gpt-oss)
        experts = _per_expert(path) and together is None
        fused = _fused_rows(path, config)
        lead = 2 if experts else 1 if stacked else 0  # the stacked dimensions before the HF tensor's own

        grouped = _grouped_rows(path, config)

        def name(layer: int | None, expert: int | None = None) -> str:
            if grouped is not None:
                return f"model.layers.{layer}.{grouped[0]}"
            return _tensor_name(path, layer, config.model_type, expert)

        holders = config.layers_holding(path[1]) if stacked else []  # the HF layers this part is stacked over
        for layer in holders if stacked else [None]:
            for expert in range(config.num_experts) if experts else [None]:
                if grouped is not None:
                    self.check_grouped(name(layer), spec.shape[lead:], grouped[1])
                    continue
                self.check_shape(path, name(layer, expert), spec.shape[lead:], fused, together)

        def block(index: tuple[slice, ...]) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
            if not stacked:
                return self.read_block(path, name(None), index, spec.dtype)
            layers = holders[index[0]]
            chosen = [(layer, e) for layer in layers for e in range(config.num_experts)[index[1]]] if experts \
                else [(layer, None) for layer in layers]
            def read(layer: int, expert: int | None) -> np.ndarray:
                if grouped is not None:
                    return self.read_grouped(name(layer), index[lead:], grouped[1], spec.dtype)
                return self.read_block(path, name(layer, expert), index[lead:], spec.dtype, fused, together)

            first = read(*chosen[0])
            out = np.empty((len(chosen), *first.shape), spec.dtype)  # filled in place: one copy at a time
            out[0] = first
            for j, (layer, expert) in enumerate(chosen[1:], start=1):
                out[j] = read(layer, expert)
            return out.reshape(len(layers), -1, *first.shape) if experts else out

        if mesh is None:
            return jax.device_put(block(()))
        sharding = NamedSharding(mesh, param_spec("/".join(path), spec.shape, mesh))
        return jax.make_array_from_callback(spec.shape, sharding, block)

    def check_all_used(self, config: ModelConfig) -> None:
        """`ConversionError` listing checkpoint tensors no parameter read (other than known, ignorable ones)."""
        ignored = [
            n for n in self.index if n not in self.used
            and (n.endswith(_IGNORED_SUFFIXES) or n.startswith(_IGNORED_PREFIXES)
                 or (n == "lm_head.weight" and config.tie_word_embeddings)
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
