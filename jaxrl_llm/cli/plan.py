"""Per-device memory planner: will this model, mesh and batch fit before anything is allocated or compiled?

    python -m jaxrl_llm.plan --model Qwen/Qwen2.5-0.5B --mesh data=1,fsdp=8,tensor=1 --batch 8 --group-size 8 \\
        --prompt-len 256 --new-tokens 512 --dtype bfloat16 --remat --device-memory 80GiB

Only `config.json` is read (a local model directory, a path to the file itself, or a hub id, for which only
that file is downloaded). Shapes come from `models.decoder.param_shapes` (`jax.eval_shape`: nothing is
allocated) and placements from the partition rules of `jaxrl_llm.sharding`, evaluated on a
`jax.sharding.AbstractMesh` of the requested axis sizes, so a `data=2,fsdp=16,tensor=8` plan runs on a laptop.

Per-device bytes (`s` = itemsize of the compute dtype, `p` = of the parameter dtype; "shard" = the
elements one device holds under the spec the rules give that array, see `shard_shape`):

- params: the float32 master weights, `sum over parameters of shard(x) * 4` (the trainers keep a float32 master
  whatever `param_dtype` is, and compute with a `param_dtype` working copy); reference params (`--reference`,
  a KL term): `sum of shard(x) * p` (a frozen copy of the starting policy in `param_dtype`, placed like the
  policy).
- optimizer state: the optimizer's state tree over the float32 master (`jax.eval_shape(optimizer.init, ...)`),
  every copy of the parameter tree sharded like the parameters, counters replicated. AdamW: `2 * params` (mu
  and nu, float32) + 17 bytes of counters.
- gradients: the train step's float32 accumulator, `sum over parameters of shard(x) * 4`.
- KV cache (sampler): `[L, B*n, S, KVH, hd]` keys and values split over `("data", "fsdp")` on the batch and
  `tensor` on the KV heads (each only when it divides): `2 * L * (B*n / (data*fsdp)) * S * (KVH / tensor) *
  hd * s`, `S = round_up(prompt_len, prompt_bucket) + round_up(new_tokens, new_tokens_bucket)`.
- sampler weight copy: the decode loop's per-layer `StepWeights` (q|k|v and gate|up concatenated, cast to the
  compute dtype, gathered over `fsdp`, split over `tensor`), made once per sampler call: see
  `sampler_weight_bytes`.
- activations of the train step: an order-of-magnitude estimate, see `activation_bytes`.

The sampler and the train step are separate XLA programs, so their buffers are never live together:

    peak = params + reference + optimizer + max(KV cache + sampler copy, gradients + activations)

Not counted: the runtime's own reservation (CUDA context, and on GPUs JAX preallocates 75% of the memory
unless `XLA_PYTHON_CLIENT_MEM_FRACTION` / `XLA_PYTHON_CLIENT_PREALLOCATE` say otherwise: pass the usable
amount as `--device-memory`), the reference model's log-prob pass (a forward only, smaller than the train
step), the prefill's transient `[B, P_b]` cache, rollout arrays, and fragmentation: keep some margin.

`plan_memory` is the pure function; the command line is a thin shell around it that prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.cli.errors import CommandParser, run_command
from jaxrl_llm.config import OptimSection, load_run_config
from jaxrl_llm.errors import UsageError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import param_shapes
from jaxrl_llm.models.hf import ConversionError, config_from_hf, read_hf_config
from jaxrl_llm.models.lora import LoraSpec, init_adapters
from jaxrl_llm.preflight import check_model_source
from jaxrl_llm.sharding import MeshShape
from jaxrl_llm.trainers.objectives import logprob_chunk_size
from jaxrl_llm.trainers.step import make_optimizer

P = PartitionSpec
# The sampler's cache `[L, B*n, S, KVH, hd]` (`init_cache`'s layout): rows over the batch axes, KV heads over
# `tensor`; the layer axis stays whole.
KV_CACHE_SPEC = P(None, sharding.BATCH_AXES, None, "tensor", None)
OPTIMIZERS = ("adamw", "lion", "sgd")
DEFAULT_MODEL = "models/arith-base"
# The trainer's sampler rounds prompt and completion lengths up to multiples of 16 (trainer.sampling_config).
TRAINER_BUCKET = 16
# Float32 `[rows, chunk, V]` blocks live at once in the log-prob head (measured on XLA:CPU, see activation_bytes).
HEAD_BLOCKS = 3


# ------------------------------------------------------------------------------------------- placement


def axis_sizes_of(mesh_sizes: Sequence[int]) -> dict[str, int]:
    """`{"data": d, "fsdp": f, "tensor": t}` from `(d, f, t)`; every size must be a positive integer."""
    sizes = tuple(int(s) for s in mesh_sizes)
    if len(sizes) != len(sharding.MESH_AXES) or any(s < 1 for s in sizes):
        raise ValueError(f"mesh sizes must be three positive integers (data, fsdp, tensor), got {mesh_sizes}")
    return dict(zip(sharding.MESH_AXES, sizes, strict=True))


def abstract_mesh(axis_sizes: Mapping[str, int]) -> AbstractMesh:
    """A device-less `(data, fsdp, tensor)` mesh of these sizes: `sharding`'s rules only read its axis sizes."""
    return AbstractMesh(tuple(int(axis_sizes[a]) for a in sharding.MESH_AXES), sharding.MESH_AXES)


def fit_spec_sizes(spec: PartitionSpec, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """`sharding.fit_spec` from axis sizes instead of a `Mesh`: every entry whose axes' size product
    `prod(axis_sizes[a] for a in entry)` does not divide its dimension is dropped (that dimension replicated).

    It calls `sharding.fit_spec` itself on an `AbstractMesh`, so the planner and the real placement share one
    divisibility rule by construction.
    """
    return sharding.fit_spec(spec, shape, abstract_mesh(axis_sizes))  # type: ignore[arg-type]


def shard_shape(shape: Sequence[int], spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """One device's block of an array of `shape` placed with `spec`: `shape[i] / prod(axis_sizes[a] for a in
    spec[i])` (missing trailing entries and `None` mean replicated, size 1).

    `spec` must already fit the shape (see `fit_spec_sizes`): a dimension its axes do not divide is an error.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the array's shape {tuple(shape)}")
    out = []
    for dim, axes in zip(shape, entries, strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        ways = math.prod(axis_sizes[a] for a in names)
        if dim % ways:
            raise ValueError(f"dimension {dim} of {tuple(shape)} is not divisible by {ways} ({spec}); fit the spec")
        out.append(dim // ways)
    return tuple(out)


def _divided(n: int, ways: int) -> int:
    """`n / ways` when `ways` divides `n`, else `n` (the fit rule: a dimension the axis does not divide stays
    replicated)."""
    return n // ways if n % ways == 0 else n


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def tree_shard_bytes(shapes: Any, specs: Any, axis_sizes: Mapping[str, int], dtype: Any = None) -> int:
    """`sum over leaves of prod(shard_shape(leaf.shape, spec, axis_sizes)) * itemsize(dtype or leaf.dtype)`:
    one device's bytes of a pytree of `ShapeDtypeStruct`s with a matching pytree of `PartitionSpec`s."""
    leaves = jax.tree.leaves(shapes)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(spec_leaves)} specs")
    return sum(
        _nbytes(shard_shape(x.shape, spec, axis_sizes), dtype or x.dtype)
        for x, spec in zip(leaves, spec_leaves, strict=True)
    )


def param_partition_specs(shapes: Any, axis_sizes: Mapping[str, int]) -> Any:
    """`sharding.param_specs` of a parameter pytree for a mesh of these sizes (no devices needed)."""
    return sharding.param_specs(shapes, abstract_mesh(axis_sizes))


# ----------------------------------------------------------------------------------------- optimizers


def make_plan_optimizer(name: str) -> optax.GradientTransformation:
    """The optimizer whose state is planned: `adamw` is the trainer's own (`train_step.make_optimizer`:
    clipping, AdamW, non-finite guard), `lion` keeps one moment, `sgd` none."""
    if name == "adamw":

        return make_optimizer(OptimSection(), total_updates=1)[0]
    if name == "lion":
        return optax.lion(1e-4)
    if name == "sgd":
        return optax.sgd(1e-3)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def optimizer_state_bytes(
    optimizer: optax.GradientTransformation, shapes: Any, axis_sizes: Mapping[str, int]
) -> int:
    """One device's bytes of `optimizer.init(params)`: the state's shapes by `jax.eval_shape`, placed by
    `sharding.optimizer_state_shardings` (parameter copies like the parameters, counters replicated).
    AdamW: `2 * sum(shard(x) * p) + 17`."""
    mesh = abstract_mesh(axis_sizes)
    state = jax.eval_shape(optimizer.init, shapes)
    shardings = sharding.optimizer_state_shardings(optimizer, state, sharding.param_shardings(shapes, mesh), mesh)
    specs = jax.tree.map(lambda s: s.spec, shardings)
    return tree_shard_bytes(state, specs, axis_sizes)


# ----------------------------------------------------------------------------------------- activations


def activation_bytes(config: ModelConfig, rows: int, seq_len: int, completion_len: int, axis_sizes: Mapping[str, int],
                     *, remat: bool, logprob_block_mib: float = 256.0) -> int:
    """Estimate of one device's activation memory in the train step (forward residuals + backward transients).

    `rows` = sequences of one micro-batch on this device, `seq_len` = `T` the forward length
    (prompt + completion - 1), `completion_len` = `C` the positions that are unembedded. With `s` the
    compute itemsize, heads `h = H/t`, KV heads `k = KVH/t`, intermediate `i = I/t`, vocabulary `v = V/t`
    (each divided by the tensor size `t` only when it divides), and `b = rows`:

        per_layer = b*T*(s*(5*D + 2*(h + k)*hd + 6*i) + 4*4*D) + b*h*q*T*(4 + s)
            (residuals kept for the backward: residual stream, norm outputs and their float32 internals,
            q/k/v/attention output, gate/up/silu/product; float32 softmax probabilities and their
            compute-dtype copy over `q = min(T, attention_query_chunk)` queries at a time; the coefficients
            5, 6 and 4*4 were measured on XLA:CPU, see below)
        head      = HEAD_BLOCKS*4*b*c*v + D*v*4 [tied] + b*T*D*4 + b*T^2
            (the log-probs come from the final hidden states `c` positions at a time, `c` =
            `train_step.logprob_chunk_size(b, C, V, logprob_block_mib)`: HEAD_BLOCKS float32 `[b, c, v]`
            blocks live at once (logits, probabilities, their cotangent); no compute-dtype copy of the output
            matrix lives across the step (the precision policy's dots keep their operands as given and cast
            them again in the backward); with tied embeddings, the head's float32 gradient before it joins the
            embedding's; final norm; the attention mask)
        gathered  = 2 * (per-layer weights with heads and intermediate divided by t) * s   when fsdp > 1
            (all-gathered weights of the layer in use and the next one)

        no remat: (L + 1) * per_layer + head + gathered
            (every layer's residuals, plus about one layer's worth of cotangents in the backward)
        remat:    L * s*b*T*D + per_layer + head + gathered
            (each layer keeps only its input; one layer's activations are rebuilt at a time)

    Calibrated against XLA's temp allocation of the real train step (`compile().memory_analysis()`) on one
    CPU device in float32: `gradients + activation_bytes` was 0.84-1.13x of it over the shapes tried (the test
    suite asserts 1.2x on one). Not calibrated: bfloat16 (XLA:CPU upcasts it; there the estimate came out
    1.2-1.6x low), the `gathered` term, and other backends, which fuse, rematerialise and reuse buffers in
    their own way: treat the number as an order-of-magnitude estimate.
    """
    t = axis_sizes["tensor"]
    b, tt, cc, s = rows, seq_len, completion_len, config.jnp_dtype.itemsize
    d, hd = config.hidden_size, config.head_dim
    h = _divided(config.num_heads, t)
    k = _divided(config.num_kv_heads, t)
    i = _divided(config.intermediate_size, t)
    v = _divided(config.vocab_size, t)
    q = min(tt, config.attention_query_chunk or tt)
    per_layer = b * tt * (s * (5 * d + 2 * (h + k) * hd + 6 * i) + 4 * 4 * d) + b * h * q * tt * (4 + s)

    chunk = logprob_chunk_size(b, cc, config.vocab_size, logprob_block_mib)
    head = HEAD_BLOCKS * 4 * b * chunk * v + b * tt * d * 4 + b * tt * tt
    head += d * v * 4 * config.tie_word_embeddings
    gathered = 0
    if axis_sizes["fsdp"] > 1:
        layer_weights = d * (h + 2 * k) * hd + h * hd * d + 3 * d * i
        gathered = 2 * layer_weights * config.jnp_dtype.itemsize
    if remat:
        return config.num_layers * s * b * tt * d + per_layer + head + gathered
    return (config.num_layers + 1) * per_layer + head + gathered


def sampler_weight_bytes(config: ModelConfig, axis_sizes: Mapping[str, int]) -> int:
    """One device's bytes of the decode loop's per-layer `StepWeights` (`models.decode.step_weights`), made once per
    sampler call in the compute dtype, gathered over `fsdp` and split over `tensor` (columns of q|k|v and
    gate|up, rows of o and down, each only when `t` divides them):

        L * s * (D*(H + 2*KVH)*hd / t + (H*hd / t)*D + D*2*I / t + (I / t)*D + biases)

    q|k|v and gate|up are concatenations, hence always new buffers; o and down are only copied when the
    compute dtype differs from the parameter dtype or `fsdp > 1` (a cast or a gather), else they are the
    parameter shards themselves and count 0 here.
    """
    t, s = axis_sizes["tensor"], config.jnp_dtype.itemsize
    d, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    qkv_cols = (config.num_heads + 2 * config.num_kv_heads) * hd
    per_layer = (d + config.qkv_bias) * _divided(qkv_cols, t) + (d + config.mlp_bias) * _divided(2 * i, t)
    if config.dtype != config.param_dtype or axis_sizes["fsdp"] > 1:
        per_layer += _divided(config.num_heads * hd, t) * d + d * config.o_bias
        per_layer += _divided(i, t) * d + d * config.mlp_bias
    return config.num_layers * per_layer * s


# ------------------------------------------------------------------------------------------------- plan


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one RL step (see the module docstring for every formula)."""

    mesh_sizes: tuple[int, int, int]
    num_params: int
    params: int
    reference: int
    optimizer: int
    gradients: int
    kv_cache: int
    sampler_weights: int
    activations_no_remat: int
    activations_remat: int
    remat: bool
    rollout_rows: int  # sequences the sampler holds per device (B*n / (data*fsdp) when divisible)
    cache_length: int  # S = rounded prompt + rounded completion
    micro_rows: int  # sequences of one micro-batch per device
    train_seq_len: int  # T of the train step's forward
    batch: int = 0  # the train step's minibatch arrays on this device (tokens, masks, old/ref log-probs, advantages)
    gradient_buffers: int = 2  # float32 gradient-sized buffers of the train step (see `update`)
    merged: int = 0  # LoRA: the merged weights (base + adapters) the sampler and the update each build
    trainable: int = 0  # parameters the optimizer updates (all, or the LoRA adapters)

    @property
    def activations(self) -> int:
        """The activation estimate for the chosen `remat`."""
        return self.activations_remat if self.remat else self.activations_no_remat

    @property
    def persistent(self) -> int:
        """Bytes that live across the whole step: `params + reference + optimizer`."""
        return self.params + self.reference + self.optimizer

    @property
    def rollout(self) -> int:
        """The sampler program's own buffers: `kv_cache + sampler_weights` (+ LoRA's merged weights)."""
        return self.kv_cache + self.sampler_weights + self.merged

    @property
    def update(self) -> int:
        """The train step's own buffers: `gradient_buffers * gradients + activations` (the float32 accumulator,
        the optimizer's update tree, and one micro-batch's gradients when `grad_accum > 1`; LoRA's merged
        weights)."""
        return self.gradient_buffers * self.gradients + self.activations + self.merged

    @property
    def train_step(self) -> int:
        """The train step program alone, what XLA's `memory_analysis()` of it reports (arguments +
        temporaries + un-aliased outputs): `params + optimizer + batch + gradients + activations`."""
        return self.params + self.optimizer + self.batch + self.update

    @property
    def total(self) -> int:
        """Peak per device: `persistent + max(rollout, update)` (the two programs never run together)."""
        return self.persistent + max(self.rollout, self.update)

    def margin(self, device_memory: int) -> int:
        """`device_memory - total` (negative: does not fit)."""
        return device_memory - self.total

    def fits(self, device_memory: int) -> bool:
        """Whether `total <= device_memory`."""
        return self.total <= device_memory


def _weight_bytes(config: ModelConfig, sizes: dict[str, int],
                  optimizer: str | optax.GradientTransformation, lora_rank: int = 0,
                  lora_targets: str = "") -> dict[str, int]:
    """One device's bytes of the float32 master weights, the reference (in `param_dtype`), the float32
    gradients and the optimizer state, and the parameter count. The trainers keep float32 master weights (and
    optimizer state) whatever `param_dtype` is (train_step.master_weights / working_weights).

    With LoRA (`lora_rank > 0`): the frozen base in `param_dtype` plus float32 adapters (replicated) instead of
    the master; gradients and optimizer state of the adapters only; no reference (the base is it); and
    `merged`, the model's weights made from both (in `param_dtype`), which the sampler and the update build."""
    shapes = param_shapes(config)
    specs = param_partition_specs(shapes, sizes)
    master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), shapes)
    opt = make_plan_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    if lora_rank:

        adapters = jax.eval_shape(lambda: init_adapters(shapes, LoraSpec(lora_rank, 1.0, lora_targets),
                                                        jax.random.key(0)))
        replicated = jax.tree.map(lambda _: PartitionSpec(), adapters)
        adapter_bytes = tree_shard_bytes(adapters, replicated, sizes)
        base = tree_shard_bytes(shapes, specs, sizes)
        return {
            "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
            "params": base + adapter_bytes,
            "reference": 0,
            "gradients": adapter_bytes,
            "optimizer": optimizer_state_bytes(opt, adapters, sizes),
            "merged": base,
            "trainable": sum(math.prod(x.shape) for x in jax.tree.leaves(adapters)),
        }
    return {
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
        "params": tree_shard_bytes(master, specs, sizes),
        "reference": tree_shard_bytes(shapes, specs, sizes),
        "gradients": tree_shard_bytes(shapes, specs, sizes, jnp.float32),
        "optimizer": optimizer_state_bytes(opt, master, sizes),
        "merged": 0,
        "trainable": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
    }


def _check_sizes(batch: int, group_size: int, prompt_len: int, new_tokens: int, minibatch: int, grad_accum: int,
                 prompt_bucket: int, new_tokens_bucket: int) -> None:
    if min(batch, group_size, prompt_len, new_tokens, grad_accum, prompt_bucket, new_tokens_bucket) < 1:
        raise ValueError("batch, group_size, prompt_len, new_tokens, grad_accum and buckets must be >= 1")
    if minibatch % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must divide the minibatch ({minibatch} sequences)")


def plan_memory(config: ModelConfig, mesh_sizes: tuple[int, int, int], *, batch: int, prompt_len: int,
                new_tokens: int, group_size: int = 1, minibatch: int = 0, grad_accum: int = 1,
                reference: bool = False, optimizer: str | optax.GradientTransformation = "adamw",
                prompt_bucket: int = 1, new_tokens_bucket: int = 1, logprob_block_mib: float = 256.0,
                lora_rank: int = 0, lora_targets: str = "(q|k|v|o|gate|up|down)_proj") -> MemoryPlan:
    """Per-device memory of an RL step of `config` (its `dtype`, `param_dtype` and `remat` are used) on a
    `(data, fsdp, tensor)` mesh of `mesh_sizes`, without devices or allocation.

    `batch` prompts x `group_size` samples are generated (`N = batch * group_size` sequences, split over
    `data * fsdp` when that divides `N`), each prompt padded to `round_up(prompt_len, prompt_bucket)` and
    completions of `new_tokens` (the cache holds `round_up(new_tokens, new_tokens_bucket)` slots). The update
    runs minibatches of `minibatch` sequences (0: all `N`) in `grad_accum` micro-batches; activations are
    per micro-batch of `minibatch / grad_accum` sequences (split over `data * fsdp` when it divides).
    """
    sizes = axis_sizes_of(mesh_sizes)
    rollout_seqs = batch * group_size
    minibatch = minibatch or rollout_seqs
    _check_sizes(batch, group_size, prompt_len, new_tokens, minibatch, grad_accum, prompt_bucket, new_tokens_bucket)
    batch_ways = sizes["data"] * sizes["fsdp"]
    weights = _weight_bytes(config, sizes, optimizer, lora_rank, lora_targets)
    padded_prompt = _round_up(prompt_len, prompt_bucket)
    cache_len = padded_prompt + _round_up(new_tokens, new_tokens_bucket)
    cache_shape = (config.num_layers, rollout_seqs, cache_len, config.num_kv_heads, config.head_dim)
    cache_block = shard_shape(cache_shape, fit_spec_sizes(KV_CACHE_SPEC, cache_shape, sizes), sizes)

    micro_rows = _divided(minibatch // grad_accum, batch_ways)
    seq_len = padded_prompt + new_tokens - 1
    acts = [activation_bytes(config, micro_rows, seq_len, new_tokens, sizes, remat=remat,
                             logprob_block_mib=logprob_block_mib) for remat in (False, True)]
    # int32 prompt/completion tokens and masks, float32 old and reference log-probs, float32 advantages.
    batch_bytes = _divided(minibatch, batch_ways) * (4 * 2 * padded_prompt + 4 * 4 * new_tokens + 4)
    return MemoryPlan(
        mesh_sizes=(sizes["data"], sizes["fsdp"], sizes["tensor"]),
        num_params=weights["num_params"],
        params=weights["params"],
        reference=weights["reference"] if reference else 0,
        merged=weights["merged"],
        trainable=weights["trainable"],
        optimizer=weights["optimizer"],
        gradients=weights["gradients"],
        kv_cache=2 * _nbytes(cache_block, config.jnp_dtype),
        sampler_weights=sampler_weight_bytes(config, sizes),
        activations_no_remat=acts[0],
        activations_remat=acts[1],
        remat=config.remat,
        rollout_rows=cache_block[1],
        cache_length=cache_len,
        micro_rows=micro_rows,
        train_seq_len=seq_len,
        batch=batch_bytes,
        gradient_buffers=2 + (grad_accum > 1),
    )


# ------------------------------------------------------------------------------------------------- CLI


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """`"80GiB"` -> 85899345920, `"80GB"` / `"80G"` -> 8e10 (decimal), `"1.5TiB"`, `"123"` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB, 16GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """Binary units: `format_bytes(3 * 2**30) == "3.00 GiB"`."""
    sign, n_abs = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n_abs >= size:
            return f"{sign}{n_abs / size:.2f} {unit}"
    return f"{sign}{n_abs} B"


def parse_mesh(text: str) -> tuple[int, int, int]:
    """`"data=2,fsdp=2,tensor=2"` (omitted axes are 1) or `"2,2,2"` -> `(data, fsdp, tensor)`."""
    sizes = dict.fromkeys(sharding.MESH_AXES, 1)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if all("=" not in p for p in parts):
            values = [int(p) for p in parts]
            if len(values) != 3:
                raise ValueError
            sizes = dict(zip(sharding.MESH_AXES, values, strict=True))
        else:
            for part in parts:
                name, value = (x.strip() for x in part.split("="))
                if name not in sizes:
                    raise ValueError
                sizes[name] = int(value)
    except ValueError:
        raise ValueError(f"cannot read mesh {text!r}; write e.g. data=2,fsdp=2,tensor=2 (axes: data, fsdp, "
                         "tensor; omitted ones are 1) or 2,2,2") from None
    checked = axis_sizes_of([sizes[a] for a in sharding.MESH_AXES])
    return checked["data"], checked["fsdp"], checked["tensor"]


def load_hf_config_dict(model: str) -> dict[str, Any]:
    """config.json of a model directory, of a path to that file, or of a hub id (downloads config.json only)."""

    path = Path(model).expanduser()
    if model == DEFAULT_MODEL and not path.exists():  # the committed model, from any working directory
        path = Path(__file__).resolve().parents[2] / DEFAULT_MODEL
    if path.is_dir():
        return read_hf_config(path)
    if path.is_file():
        return json.loads(path.read_text())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ConversionError(f"model directory {path} does not exist (nor is it a hub id)")

    check_model_source("--model", model)  # offline or unknown: one line at once, not the download's retries
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as e:  # offline, unknown repo, gated model: say which file of which id failed
        raise ConversionError(f"could not fetch config.json of hub id {model!r}: {e}") from e


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m jaxrl_llm.plan",
        description="Per-device memory of an RL step (params, reference, optimizer, gradients, KV cache, "
        "activations) from config.json alone, and whether it fits. `--config FILE [overrides]` plans the run "
        "that training config describes (its model, mesh, batch sizes, lengths, dtypes, remat, reference); "
        "the options below override it.",
    )
    p.add_argument("--config", type=Path, help="a training YAML (as train.py --config), with dotted overrides")
    p.add_argument("overrides", nargs="*", help="dotted overrides of --config, e.g. rl.group_size=16")
    p.add_argument("--model", help="HF model directory, config.json or hub id (or the --config run's model.path)")
    p.add_argument("--mesh", help="e.g. data=2,fsdp=2,tensor=2 (default: 1,1,1, or the config's mesh)")
    p.add_argument("--devices", type=int, help="devices, for a config mesh with a -1 axis (default: what JAX sees)")
    p.add_argument("--prompts-per-step", "--batch", dest="prompts_per_step", type=int,
                   help="rl.prompts_per_step: prompts per step (default 16)")
    p.add_argument("--group-size", type=int, help="rl.group_size: samples per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, help="data.max_prompt_tokens: prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, help="sampling.max_new_tokens (default 64)")
    p.add_argument("--minibatch", type=int, help="rl.minibatch_size: sequences per update (0: all; default 0)")
    p.add_argument("--grad-accum", type=int, help="rl.grad_accum: micro-batches per update (default 1)")
    p.add_argument("--bucket", type=int,
                   help="round prompt and completion lengths up to a multiple (default: the sampler's 16)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="model.dtype: compute dtype")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), help="model.param_dtype")
    p.add_argument("--remat", action="store_true", default=None, help="model.remat: rematerialise each layer")
    p.add_argument("--attention-query-chunk", type=int,
                   help="model.attention_query_chunk: queries per attention block (0: all at once; default 128)")
    p.add_argument("--reference", action="store_true", default=None,
                   help="a frozen reference copy (rl.beta > 0; from a config: beta > 0, or PPO's KL)")
    p.add_argument("--lora-rank", type=int, help="lora.rank: LoRA adapters of this rank over a frozen base (0: off)")
    p.add_argument("--lora-targets", help="lora.targets: regex of the adapted kernels' module names")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--logprob-block-mib", type=float,
                   help="model.logprob_block_mib: MiB of one float32 log-prob block (0: one block; default 256)")
    p.add_argument("--device-memory", default="80GiB", help="usable memory per device, e.g. 80GiB, 24GB")
    return p


# (argparse dest, default without a config, the same setting in a RunConfig)
_SETTINGS: tuple[tuple[str, Any, Any], ...] = (
    ("model", "", lambda c: c.model.path),
    ("prompts_per_step", 16, lambda c: c.rl.prompts_per_step),
    ("group_size", 8, lambda c: c.rl.group_size),
    ("prompt_len", 64, lambda c: c.data.max_prompt_tokens),
    ("new_tokens", 64, lambda c: c.sampling.max_new_tokens),
    ("minibatch", 0, lambda c: c.rl.minibatch_size),
    ("grad_accum", 1, lambda c: c.rl.grad_accum),
    ("bucket", TRAINER_BUCKET, lambda c: None),  # from a config: its own two buckets (below)
    ("dtype", "float32", lambda c: c.model.dtype),
    ("param_dtype", "float32", lambda c: c.model.param_dtype),
    ("remat", False, lambda c: c.model.remat),
    ("attention_query_chunk", 128, lambda c: c.model.attention_query_chunk),
    ("reference", False, lambda c: c.rl.beta > 0 or (c.algo == "ppo" and c.ppo.kl_coef_init > 0)),
    ("logprob_block_mib", 256.0, lambda c: c.model.logprob_block_mib),
    ("lora_rank", 0, lambda c: c.lora.rank),
    ("lora_targets", "(q|k|v|o|gate|up|down)_proj", lambda c: c.lora.targets),
)


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The planned run's settings: command-line options over the `--config` run's, over the defaults."""

    config = load_run_config(args.config, args.overrides) if args.config else None
    if args.overrides and config is None:
        raise UsageError(f"overrides {args.overrides} need --config FILE (options such as --group-size work alone)")
    out: dict[str, Any] = {}
    for name, default, from_config in _SETTINGS:
        given = getattr(args, name)
        out[name] = given if given is not None else from_config(config) if config is not None else default
    if out["bucket"] is None:
        sampling = config.sampling  # type: ignore[union-attr]
        out["prompt_bucket"], out["new_tokens_bucket"] = sampling.prompt_bucket, sampling.new_tokens_bucket
    else:
        out["prompt_bucket"] = out["new_tokens_bucket"] = out["bucket"]
    if args.mesh:
        out["mesh"] = parse_mesh(args.mesh)
    elif config is not None:

        devices = args.devices or jax.device_count()
        out["mesh"] = MeshShape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor).resolve(devices)
    else:
        out["mesh"] = (1, 1, 1)
    if not out["model"]:
        raise UsageError("no model to plan: give --model DIR_OR_HUB_ID, or --config FILE of a run")
    return out


def render(plan: MemoryPlan, config: ModelConfig, device_memory: int, *, model: str = "",
           optimizer: str = "adamw") -> str:
    """The CLI's table for `plan`."""
    c = config
    d, f, t = plan.mesh_sizes

    def row(label: str, n: int | None, note: str = "") -> str:
        value = "-" if n is None else format_bytes(n)
        return f"  {label:<36}{value:>12}  {note}".rstrip()

    act_note = (f"order-of-magnitude estimate; no remat {format_bytes(plan.activations_no_remat)}, "
                f"remat {format_bytes(plan.activations_remat)}")
    lines = [
        f"model {model or '?'}: {c.model_type}, {plan.num_params / 1e6:,.2f}M params "
        f"(L={c.num_layers} D={c.hidden_size} H={c.num_heads} KVH={c.num_kv_heads} hd={c.head_dim} "
        f"I={c.intermediate_size} V={c.vocab_size}{' tied' if c.tie_word_embeddings else ''})",
        f"mesh data={d} fsdp={f} tensor={t} ({d * f * t} devices); params {c.param_dtype}, compute {c.dtype}, "
        f"{optimizer}, remat {'on' if c.remat else 'off'}",
        f"rollout: {plan.rollout_rows} sequences per device, KV cache length {plan.cache_length}; "
        f"update: {plan.micro_rows} sequences x {plan.train_seq_len} tokens per device per micro-batch",
        "",
        f"  {'per device':<36}{'bytes':>12}",
        row("params (policy)" if not plan.merged else "params (frozen base + LoRA adapters)", plan.params,
            f"{plan.trainable / 1e6:,.2f}M trainable" if plan.merged else ""),
        row("reference params", plan.reference if plan.reference else None,
            "(the frozen base: adapters off)" if plan.merged else "" if plan.reference else "(no --reference)"),
        row(f"optimizer state ({optimizer})", plan.optimizer),
        row("gradients (float32 accumulator)", plan.gradients),
        row("KV cache (sampler)", plan.kv_cache),
        row("sampler weight copy", plan.sampler_weights),
        *([row("LoRA merged weights (rollout, update)", plan.merged)] if plan.merged else []),
        row(f"activations (train step{', remat' if plan.remat else ''})", plan.activations, act_note),
        "  " + "-" * 48,
        row("persistent: params+ref+optimizer", plan.persistent),
        row("rollout: KV cache+sampler copy", plan.rollout),
        row("update: gradients+activations", plan.update),
        row("train step program alone", plan.train_step,
            "params+optimizer+batch+update: what XLA's memory_analysis() reports"),
        row("total (persistent + max of phases)", plan.total),
        row("device memory", device_memory),
        "",
    ]
    margin = plan.margin(device_memory)
    if plan.fits(device_memory):
        lines.append(f"FITS: margin {format_bytes(margin)} ({100 * margin / device_memory:.1f}% of the device free)")
    else:
        lines.append(f"DOES NOT FIT: short by {format_bytes(-margin)} ({plan.total / device_memory:.2f}x the device)"
                     "; try a larger fsdp, --remat, --grad-accum, bfloat16, or a smaller batch")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrl_llm.plan ...`: print the plan table; exit 0 whether or not it fits, 2 on bad input."""
    args = _parser().parse_intermixed_args(argv)

    try:
        run = resolve_settings(args)
        device_memory = parse_bytes(args.device_memory)
        config = config_from_hf(load_hf_config_dict(run["model"]), dtype=run["dtype"], param_dtype=run["param_dtype"],
                                remat=run["remat"], attention_query_chunk=run["attention_query_chunk"])
        plan = plan_memory(
            config, run["mesh"], batch=run["prompts_per_step"], group_size=run["group_size"],
            prompt_len=run["prompt_len"], new_tokens=run["new_tokens"], minibatch=run["minibatch"],
            grad_accum=run["grad_accum"], reference=run["reference"], optimizer=args.optimizer,
            prompt_bucket=run["prompt_bucket"], new_tokens_bucket=run["new_tokens_bucket"],
            logprob_block_mib=run["logprob_block_mib"], lora_rank=run["lora_rank"], lora_targets=run["lora_targets"],
        )
    except (ValueError, OSError) as e:  # bad sizes, mesh or model: the user's input (ConversionError included)
        raise UsageError(str(e)) from e
    if args.config:
        print(f"planning {args.config}: rl.prompts_per_step={run['prompts_per_step']} x rl.group_size="
              f"{run['group_size']}, data.max_prompt_tokens={run['prompt_len']}, sampling.max_new_tokens="
              f"{run['new_tokens']}, rl.minibatch_size={run['minibatch']}, rl.grad_accum={run['grad_accum']}")
    print(render(plan, config, device_memory, model=run["model"], optimizer=args.optimizer))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m jaxrl_llm.plan", main))
