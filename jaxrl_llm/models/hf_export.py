"""Writing a Hugging Face model directory: `save_hf_model(params, config, out_dir)` writes config.json, safetensors
(sharded above a size threshold, with an index) and carries tokenizer files over, so
`AutoModelForCausalLM.from_pretrained` loads the result; `hf_state_dict` yields the tensors one at a time in HF
names and layouts (Flax `[in, out]` kernels back to `[out, in]`, Phi-3's fused tensors rejoined)."""

from __future__ import annotations

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
from safetensors.numpy import save_file

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.families import FAMILIES
from jaxrl_llm.models.hf import _fused_rows, _grouped_rows, _is_kernel, _per_expert, _stacked, _tensor_name
from jaxrl_llm.models.hf_config import config_to_hf
from jaxrl_llm.models.tokenizer import TOKENIZER_FILES

# Files a model directory may carry besides weights and config, copied verbatim on export: the tokenizer's (any
# of `models.tokenizer.TOKENIZER_FILES` makes one) and their companions.
COPIED_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "generation_config.json")


def hf_state_dict(params: Params, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(HF tensor name, numpy array)` one tensor at a time, in HF layouts; Phi-3's q|k|v and gate|up
    are concatenated back into their fused tensors, gpt-oss's gate and up interleaved back into gate_up (each
    yielded once all its parts are in)."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    pending: dict[str, dict[int, np.ndarray]] = {}
    for key_path, leaf in flat:
        path = tuple(k.key for k in key_path)
        array = np.asarray(jax.device_get(leaf))
        together = _stacked(path, config.model_type)
        if together is not None:
            yield from _interleaved(array, path, together, config, pending)
            continue
        grouped = _grouped_rows(path, config)
        if grouped is not None:
            yield from _grouped(array, grouped, config, pending)
            continue
        fused = _fused_rows(path, config)
        layers = list(enumerate(config.layers_holding(path[1]))) if path[0] == "layers" else [(None, None)]
        experts = range(config.num_experts) if _per_expert(path) else [None]
        for (slot, layer), expert in itertools.product(layers, experts):
            tensor = array[slot] if slot is not None else array
            tensor = tensor[expert] if expert is not None else tensor
            tensor = np.ascontiguousarray(tensor.T if _is_kernel(path) else tensor)
            name = _tensor_name(path, layer, config.model_type, expert)
            if fused is None:
                yield name, tensor
                continue
            parts = pending.setdefault(name, {})
            parts[fused[0]] = tensor
            if sum(p.shape[0] for p in parts.values()) == fused[2]:
                yield name, np.concatenate([parts[k] for k in sorted(parts)], axis=0)
                del pending[name]


def _grouped(array: np.ndarray, grouped: tuple[str, np.ndarray], config: ModelConfig,
             pending: dict[str, dict[int, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Per layer, the HF tensor whose rows interleave several of our kernels by head group (Qwen3-Next's): our kernel
    `[L, in, out]`'s columns go to rows `grouped[1]`, and the tensor is yielded once every row is filled."""
    suffix, rows = grouped
    total = sum(len(r) for n, r in FAMILIES[config.model_type].grouped_tensors(config).values() if n == suffix)
    for slot, layer in enumerate(config.layers_holding("linear_attn")):
        name = f"model.layers.{layer}.{suffix}"
        got = pending.setdefault(name, {})
        got[int(rows[0])] = (rows, array[slot].T)  # type: ignore[assignment]
        if sum(len(r) for r, _ in got.values()) == total:  # type: ignore[misc]
            first = next(iter(got.values()))[1]  # type: ignore[index]
            out = np.empty((total, first.shape[1]), first.dtype)
            for r, block in got.values():  # type: ignore[misc]
                out[r] = block
            del pending[name]
            yield name, out


def _interleaved(array: np.ndarray, path: tuple[str, ...], together: tuple[str, int, int], config: ModelConfig,
                 pending: dict[str, dict[int, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """Per layer, the HF tensor holding every expert's `path` (`[L, E, ..., n]` ours), its last axis interleaving
    `parts` parameters: yielded when the last of them arrives (`pending` holds the others by name)."""
    _, part, parts = together
    for layer in range(config.num_layers):
        name = _tensor_name(path, layer, config.model_type)
        got = pending.setdefault(name, {})
        got[part] = array[layer]
        if len(got) == parts:
            first = got[0]
            out = np.empty((*first.shape[:-1], first.shape[-1] * parts), first.dtype)
            for p, tensor in got.items():
                out[..., p::parts] = tensor
            del pending[name]
            yield name, out


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
        for name in COPIED_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copyfile(src, out / name)
    return out
