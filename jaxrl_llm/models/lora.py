"""LoRA (Hu et al. 2021): low-rank adapters as their own pytree beside frozen base weights.

For each targeted kernel `W [L, in, out]` (every layer of the stack: `x @ W`), two float32 factors

    A [L, in, r] ~ U(-1/sqrt(in), 1/sqrt(in)),   B [L, r, out] = 0,   W' = W + (alpha / r) * A @ B

so at initialisation the model is exactly the base. Training differentiates and updates only `{A, B}` (the
optimizer state is adapter-sized); the base is an input nobody updates, and it is the reference model too
(adapters off), so no second copy of the weights exists. The model's weights are `merge_adapters(base, adapters)`
(one `[L, in, out]` product per targeted kernel): the training forward, the sampler's token step and the export
use that merged pytree. With `lora.dropout > 0` only the update runs unmerged (`insert_adapters`: the decoder's
dense layers compute `x W + (alpha / r) * dropout(x) A B`, PEFT's form); sampling and export stay merged,
dropout being off outside training.

`targets` is a regular expression searched in each stacked kernel's Hugging Face module name
(`model.layers.0.self_attn.q_proj`, `model.layers.0.mlp.down_proj`, ...); embeddings, norms and the output head
are never adapted. `peft_tensors` / `save_peft_adapters` write the adapters as PEFT does
(`adapter_config.json` + `adapter_model.safetensors`, `lora_A.weight [r, in]`, `lora_B.weight [out, r]`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.errors import ConfigError, ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.families import FAMILIES
from jaxrl_llm.models.hf import _per_expert, _tensor_name
from jaxrl_llm.models.hf_export import set_plain_file_mode

Params = dict[str, Any]
LORA_A, LORA_B = "lora_a", "lora_b"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapters' shape and scale: rank `r`, `alpha` (the update is scaled by `alpha / r`), target regex."""

    rank: int
    alpha: float
    targets: str

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _kernel_paths(params: Params, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in params.items():
        if isinstance(value, dict):
            yield from _kernel_paths(value, (*prefix, key))
        elif key == "kernel" and prefix and prefix[0] == "layers" and prefix[-1] != "conv":  # conv: no matmul
            yield (*prefix, key)


def module_name(path: tuple[str, ...]) -> str:
    """The Hugging Face module of a stacked kernel, as in layer 0 (and expert 0): `model.layers.0.self_attn.q_proj`,
    `model.layers.0.mlp.experts.0.gate_proj`."""
    return _tensor_name(path, 0, expert=0 if _per_expert(path) else None).removesuffix(".weight")


def target_paths(params: Params, targets: str) -> list[tuple[str, ...]]:
    """The stacked kernels whose module name `targets` matches (`re.search`); a `ConfigError` if none."""
    pattern = re.compile(targets)
    paths = [p for p in _kernel_paths(params) if pattern.search(module_name(p))]
    if not paths:
        names = ", ".join(module_name(p).removeprefix("model.layers.0.") for p in _kernel_paths(params))
        raise ConfigError(f"lora.targets={targets!r} matches no layer kernel; the kernels are: {names}")
    return paths


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def init_adapters(params: Params, spec: LoraSpec, key: jax.Array) -> Params:
    """`{path...: {"lora_a": A, "lora_b": B}}` for every targeted kernel (nested like `params`, float32)."""
    adapters: Params = {}
    for i, path in enumerate(target_paths(params, spec.targets)):
        *lead, fan_in, fan_out = _get(params, path).shape  # [L, in, out], or an MoE's [L, E, in, out]: per expert
        bound = 1.0 / np.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (*lead, fan_in, spec.rank), jnp.float32, -bound, bound)
        node = adapters
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[LORA_A], node[LORA_B] = a, jnp.zeros((*lead, spec.rank, fan_out), jnp.float32)
    return adapters


def _adapter_paths(adapters: Params, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in adapters.items():
        if key == LORA_A:
            yield prefix
        elif isinstance(value, dict):
            yield from _adapter_paths(value, (*prefix, key))


def merge_adapters(base: Params, adapters: Params, scale: float) -> Params:
    """`base` with `scale * A @ B` added to each adapted kernel (in the kernel's dtype); pure and jittable."""
    merged = jax.tree.map(lambda x: x, base)  # a new tree (leaves shared) to write the merged kernels into
    for path in _adapter_paths(adapters):
        node, ab = merged, _get(adapters, path)
        for key in path:
            node[key] = dict(node[key])
            node = node[key]
        kernel = node["kernel"]
        delta = jnp.einsum("...ir,...ro->...io", ab[LORA_A].astype(jnp.float32), ab[LORA_B].astype(jnp.float32))
        node["kernel"] = (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
    return merged


def _flat_adapters(adapters: Params) -> dict[tuple[str, ...], Params]:
    return {path: _get(adapters, path) for path in _adapter_paths(adapters)}


def _nested(flat: dict[tuple[str, ...], Params]) -> Params:
    out: Params = {}
    for path, ab in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = ab
    return out


def insert_adapters(base: Params, adapters: Params, scale: float = 1.0) -> Params:
    """`base` with each adapted module's `lora_a` / `lora_b` beside its kernel, unmerged: the decoder's dense
    layers then add `lora_scale * dropout(x) @ A @ B` (`ModelConfig.lora_scale / lora_dropout`). What training
    with `lora.dropout > 0` runs; without dropout it equals `merge_adapters` (tested). An MoE's expert adapters are
    merged (`scale`), without dropout: the grouped matmul takes the experts' matrices whole."""
    experts = {p: v for p, v in _flat_adapters(adapters).items() if _per_expert((*p, "kernel"))}
    out = merge_adapters(base, _nested(experts), scale) if experts else jax.tree.map(lambda x: x, base)
    for path in _adapter_paths(adapters):
        if path in experts:  # an expert's adapters are merged: they reach the experts through the grouped matmul
            continue
        node, ab = out, _get(adapters, path)
        for key in path:
            node[key] = dict(node[key])
            node = node[key]
        node[LORA_A], node[LORA_B] = ab[LORA_A], ab[LORA_B]
    return out


def peft_tensors(adapters: Params, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """`(PEFT tensor name, array)`: `base_model.model.<module>.lora_A.weight [r, in]`, `lora_B.weight [out, r]`."""
    for path in _adapter_paths(adapters):
        ab = _get(adapters, path)
        a, b = np.asarray(jax.device_get(ab[LORA_A])), np.asarray(jax.device_get(ab[LORA_B]))
        for slot, layer in enumerate(config.layers_holding(path[1])):  # a hybrid stack's parts: their layers
            module = _tensor_name((*path, "kernel"), layer).removesuffix(".weight")
            yield f"base_model.model.{module}.lora_A.weight", np.ascontiguousarray(a[slot].T)
            yield f"base_model.model.{module}.lora_B.weight", np.ascontiguousarray(b[slot].T)


def save_peft_adapters(adapters: Params, config: ModelConfig, spec: LoraSpec, directory: str | Path,
                       base_model: str) -> Path:
    """PEFT's LoRA format in `directory`: `adapter_config.json` and `adapter_model.safetensors` (float32)."""
    from safetensors.numpy import save_file

    if any(_per_expert((*path, "kernel")) for path in _adapter_paths(adapters)):
        raise ConversionError("PEFT adapters on an MoE model's experts are not exported (transformers 5 fuses the "
                              "experts' matrices, which PEFT's per-module adapters do not target); use the merged "
                              "export (lora.export_adapters=false) or lora.targets without the experts, e.g. "
                              "'(q|k|v|o)_proj'")
    if FAMILIES[config.model_type].fused_tensors:
        raise ConversionError(f"PEFT adapters for {config.model_type} would sit on its fused qkv_proj / gate_up_proj, "
                              f"not on our separate q/k/v and gate/up adapters; use the merged export "
                              f"(lora.export_adapters=false)")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(peft_tensors(adapters, config))
    modules = sorted({name.split(".")[-3] for name in tensors})
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    set_plain_file_mode(out / "adapter_model.safetensors")  # save_file leaves it 0600: readable by no one else
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
        "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out
