"""`plan_memory`: one device's bytes of an RL step of a model on a mesh, as a `MemoryPlan` (the module docstring of
`jaxrl_llm.memory_plan` has every formula).

The arguments of `plan_memory`:

`batch` prompts x `group_size` samples are generated (`N = batch * group_size` sequences, split over
`data * fsdp * expert` when that divides `N`), each prompt padded to `round_up(prompt_len, prompt_bucket)` and
completions of `new_tokens` (the cache holds `round_up(new_tokens, new_tokens_bucket)` slots). The update
runs minibatches of `minibatch` sequences (0: all `N`) in `grad_accum` micro-batches; activations are
per micro-batch of `minibatch / grad_accum` sequences (split over `data * fsdp * expert` when it divides).

`engine_page_size > 0` plans the rollout engine (`sampling.engine=paged`, the default) instead of the static
sampler's cache: its pool of `engine_pages` pages (0: `batch * (ceil(P / ps) + n * ceil((P + T) / ps)) + 1`,
the prompt once per group), split between the data-parallel shards (one engine per position of `data * fsdp *
expert`, `engine/sharded.py`) with its KV heads split over `tensor`, plus, with `engine_slot_caches` (the XLA
path: a shard of several `tensor` devices, or `sampling.engine_attention=xla`), the contiguous per-call caches
its decode gathers for every slot (`N` rows, split over `data * fsdp * expert`, of
`ceil((P + T) / ps)` pages as `engine.pages.table_width` rounds them; a kernel reads the pages instead;
docs/engine.md). `engine_packed_weights` (the engine's AMX matmul: one CPU device with AMX, a bfloat16
model, the CPU attention kernel): the decode step's matrices and LM head packed once more per generate call,
`packed_weight_bytes`, in the sampler weight copy.

`max_tokens_per_microbatch` (`rl.max_tokens_per_microbatch`, packed): a micro-batch is packed rows of the
padded length `S` holding at most that many real tokens, so its activations are those of
`min(minibatch, ceil(11/9 * ceil(budget / S)) + 1)` rows (first-fit decreasing's bound on its rows); without
it the padded micro-batch is planned, an upper bound of its packed rows.

`teacher` (`--algo distill`): the frozen teacher's weights in its `param_dtype`, sharded by the same rules,
live through the step; with `teacher_in_update` (`distill.loss=jsd`) its final hidden states of a micro-batch
`[rows, T, D_teacher]` float32 are part of the update (its forward runs there, without gradients).

`max_staleness` K > 0: the sampler's `K + 1` copies of the inference weights (`param_dtype`) beside both
programs; `sampler_mesh_sizes` (`rollout.sampler_devices`): the sampler's own `(data, 1, tensor)` mesh, where
those copies, its KV cache and its sampler copy live instead (`mesh_sizes` is then the trainer's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxrl_llm.engine.pages import table_width
from jaxrl_llm.memory_plan.parts import (
    activation_bytes,
    optimizer_state_bytes,
    packed_weight_bytes,
    sampler_weight_bytes,
    trainer_optimizer,
)
from jaxrl_llm.memory_plan.shards import (
    KV_CACHE_SPEC,
    array_bytes,
    axis_sizes_of,
    divided,
    fit_spec_sizes,
    mesh_tuple,
    param_partition_specs,
    shard_shape,
    tree_shard_bytes,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import param_shapes as decoder_param_shapes
from jaxrl_llm.models.lora import LoraSpec, init_adapters

DEFAULT_MODEL = "models/arith-base"
# The trainer's sampler rounds prompt and completion lengths up to multiples of 16 (trainer.sampling_config).
TRAINER_BUCKET = 16


@functools.lru_cache(maxsize=8)
def param_shapes(config: ModelConfig) -> Any:
    """`decoder.param_shapes`, traced once per config (a plan reads it several times; `longest_context` plans
    many contexts of one model)."""
    return decoder_param_shapes(config)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one RL step (see the module docstring for every formula)."""

    mesh_sizes: tuple[int, int, int, int]  # (data, fsdp, expert, tensor)
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
    teacher: int = 0  # --algo distill: the frozen teacher's weights (param_dtype, sharded like the reference)
    teacher_hidden: int = 0  # distill.loss=jsd: the teacher's final hidden states of one micro-batch (in the update)
    max_staleness: int = 0  # rollout.max_staleness: K > 0 samples beside the update
    weight_copies: int = 0  # the sampler's K + 1 inference-weight copies, on a device where it samples
    sampler_mesh_sizes: tuple[int, int, int, int] | None = None  # rollout.sampler_devices: the sampler's own mesh
    sampler_kv_cache: int = 0  # on a sampler device (its own mesh)
    sampler_step_weights: int = 0  # on a sampler device (its own mesh)
    sequence: int = 1  # mesh.sequence: the update's positions split over this many devices (context parallelism)

    @property
    def activations(self) -> int:
        """The activation estimate for the chosen `remat`."""
        return self.activations_remat if self.remat else self.activations_no_remat

    @property
    def persistent(self) -> int:
        """Bytes that live across the whole step: `params + reference + teacher + optimizer`."""
        return self.params + self.reference + self.teacher + self.optimizer

    @property
    def rollout(self) -> int:
        """The sampler program's own buffers: `kv_cache + sampler_weights` (+ LoRA's merged weights)."""
        return self.kv_cache + self.sampler_weights + self.merged

    @property
    def update(self) -> int:
        """The train step's own buffers: `gradient_buffers * gradients + activations` (the float32 accumulator,
        the optimizer's update tree, and one micro-batch's gradients when `grad_accum > 1`; LoRA's merged
        weights; a JSD teacher's hidden states)."""
        return self.gradient_buffers * self.gradients + self.activations + self.merged + self.teacher_hidden

    @property
    def train_step(self) -> int:
        """The train step program alone, what XLA's `memory_analysis()` of it reports (arguments +
        temporaries + un-aliased outputs): `params + optimizer + batch + gradients + activations`."""
        return self.params + self.optimizer + self.batch + self.update

    @property
    def total(self) -> int:
        """Peak per (trainer) device: `persistent + max(rollout, update)` (the two programs never run together);
        sampling beside the update on one mesh, `persistent + weight_copies + rollout + update`; on a sampler mesh
        of its own, `persistent + update` (`sampler_total` is the sampler's)."""
        if self.sampler_mesh_sizes is not None:
            return self.persistent + self.update
        if self.max_staleness:
            return self.persistent + self.weight_copies + self.rollout + self.update
        return self.persistent + max(self.rollout, self.update)

    @property
    def sampler_total(self) -> int:
        """Peak per device of a sampler mesh of its own: `weight_copies + sampler_kv_cache + sampler_step_weights`
        (0 without one)."""
        if self.sampler_mesh_sizes is None:
            return 0
        return self.weight_copies + self.sampler_kv_cache + self.sampler_step_weights

    def margin(self, device_memory: int) -> int:
        """`device_memory - total`, or the smaller margin of the trainer's and the sampler's devices (negative:
        does not fit)."""
        return device_memory - max(self.total, self.sampler_total)

    def fits(self, device_memory: int) -> bool:
        """Whether `total` (and `sampler_total`) <= `device_memory`."""
        return self.margin(device_memory) >= 0


def _weight_bytes(config: ModelConfig, sizes: dict[str, int],
                  optimizer: optax.GradientTransformation | None, lora_rank: int = 0,
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
    opt = trainer_optimizer() if optimizer is None else optimizer
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


def _engine_kv_bytes(config: ModelConfig, on: Mapping[str, int], *, padded_prompt: int, new_tokens: int,
                     batch: int, group_size: int, page_size: int, pages: int, slot_caches: bool) -> int:
    """The engine's pool and one decode call's slot caches on a device of the mesh `on`: the pool and the slots
    split between the data-parallel shards (`data * fsdp * expert`), KV heads over `tensor` where they divide."""
    kv_heads = divided(config.num_kv_heads, on["tensor"])
    per_token = 2 * array_bytes((config.num_layers, kv_heads, config.head_dim), config.jnp_dtype)
    sample_pages = -(-(padded_prompt + new_tokens) // page_size)
    shards = on["data"] * on["fsdp"] * on["expert"]
    pool = -(-(pages or batch * (-(-padded_prompt // page_size) + group_size * sample_pages) + 1) // shards)
    slot_rows = divided(batch * group_size, shards) if slot_caches else 0
    return (pool * page_size + slot_rows * table_width(sample_pages, page_size) * page_size) * per_token


def _micro_rows(minibatch: int, grad_accum: int, batch_ways: int, seq_len: int, max_tokens_per_microbatch: int) -> int:
    """Sequences of one micro-batch per device: `minibatch / grad_accum`, or with a token budget the packed rows
    first-fit decreasing needs at most (`ceil(11/9 * ceil(budget / S)) + 1`)."""
    rows = minibatch // grad_accum
    if max_tokens_per_microbatch:
        rows = min(minibatch, -(-11 * -(-max_tokens_per_microbatch // seq_len) // 9) + 1)
    return divided(rows, batch_ways)


def _teacher_bytes(teacher: ModelConfig | None, sizes: dict[str, int], in_update: bool,
                   hidden_rows: int) -> tuple[int, int]:
    """A distillation teacher's weights (`param_dtype`, sharded by the same rules) and, when its forward runs in the
    update, its float32 final hidden states of `hidden_rows` positions."""
    if teacher is None:
        return 0, 0
    shapes = param_shapes(teacher)
    hidden = hidden_rows * teacher.hidden_size * 4 if in_update else 0
    return tree_shard_bytes(shapes, param_partition_specs(shapes, sizes), sizes), hidden


def linear_state_bytes(config: ModelConfig) -> int:
    """One sequence's state over a hybrid stack's linear-attention layers (`decode.empty_linear_state`): the
    convolution's window `(K - 1) x (2 Kd + Vd)` in the activation dtype and the float32 `[Hv, dk, dv]` state per
    layer, whatever the sequence's length; 0 without such layers."""
    lin = config.linear
    if lin is None:
        return 0
    per_layer = ((lin.conv_kernel - 1) * lin.conv_dim * config.jnp_activation_dtype.itemsize
                 + 4 * lin.num_value_heads * lin.key_head_dim * lin.value_head_dim)
    return len(config.layers_holding("linear_attn")) * per_layer


def _static_kv_bytes(config: ModelConfig, cache_shape: tuple[int, ...], on: dict[str, int]) -> tuple[int, int]:
    """The static sampler's keys and values on a device of the mesh `on`, and the rows each device holds."""
    block = shard_shape(cache_shape, fit_spec_sizes(KV_CACHE_SPEC, cache_shape, on), on)
    return 2 * array_bytes(block, config.jnp_dtype), block[1]


def plan_memory(config: ModelConfig, mesh_sizes: tuple[int, ...], *, batch: int, prompt_len: int,
                new_tokens: int, group_size: int = 1, minibatch: int = 0, grad_accum: int = 1,
                reference: bool = False, optimizer: optax.GradientTransformation | None = None,
                prompt_bucket: int = 1, new_tokens_bucket: int = 1, logprob_block_mib: float = 256.0,
                lora_rank: int = 0, lora_targets: str = "(q|k|v|o|gate|up|down)_proj", engine_page_size: int = 0,
                engine_pages: int = 0, teacher: ModelConfig | None = None, teacher_in_update: bool = False,
                max_tokens_per_microbatch: int = 0, max_staleness: int = 0,
                sampler_mesh_sizes: tuple[int, ...] | None = None, engine_slot_caches: bool = True,
                engine_packed_weights: bool = False, sequence: int = 1) -> MemoryPlan:
    """Per-device memory of an RL step of `config` (its `dtype`, `param_dtype` and `remat` are used) on a
    `(data, fsdp, expert, tensor)` mesh of `mesh_sizes` (or `(data, fsdp, tensor)`) times a `sequence` axis (each of
    those devices' update positions split over `sequence` more), without devices or allocation. What each argument
    plans: this module's docstring."""
    sizes = axis_sizes_of(mesh_sizes)
    minibatch = minibatch or batch * group_size
    _check_sizes(batch, group_size, prompt_len, new_tokens, minibatch, grad_accum, prompt_bucket, new_tokens_bucket)
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    weights = _weight_bytes(config, sizes, optimizer, lora_rank, lora_targets)
    weights["reference"] *= reference
    padded_prompt = _round_up(prompt_len, prompt_bucket)
    cache_len = padded_prompt + _round_up(new_tokens, new_tokens_bucket)
    # A hybrid stack's softmax layers keep keys and values; its linear layers a fixed-size state per sequence.
    cache_shape = (len(config.layers_holding("attn")), batch * group_size, cache_len, config.num_kv_heads,
                   config.head_dim)
    engine = dict(padded_prompt=padded_prompt, new_tokens=new_tokens, batch=batch, group_size=group_size,
                  page_size=engine_page_size, pages=engine_pages, slot_caches=engine_slot_caches)

    def kv_bytes(on: dict[str, int]) -> int:
        if engine_page_size and not config.is_hybrid:  # a hybrid stack samples with the static sampler
            return _engine_kv_bytes(config, on, **engine)
        keys_values, rows = _static_kv_bytes(config, cache_shape, on)
        return keys_values + rows * linear_state_bytes(config)

    seq_len = padded_prompt + new_tokens - 1
    micro_rows = _micro_rows(minibatch, grad_accum, batch_ways, seq_len, max_tokens_per_microbatch)
    if sequence < 1:
        raise ValueError(f"the sequence axis has at least 1 device, not {sequence}")
    acts = [activation_bytes(config, micro_rows, seq_len, new_tokens, sizes, remat=remat,
                             logprob_block_mib=logprob_block_mib, sequence=sequence) for remat in (False, True)]
    teacher_bytes, teacher_hidden = _teacher_bytes(teacher, sizes, teacher_in_update, micro_rows * seq_len)
    own_mesh = sampler_mesh_sizes is not None
    where = axis_sizes_of(sampler_mesh_sizes) if own_mesh else sizes
    copy = tree_shard_bytes(param_shapes(config), param_partition_specs(param_shapes(config), where), where)
    packed = packed_weight_bytes(config) if engine_packed_weights else 0
    return MemoryPlan(
        mesh_sizes=mesh_tuple(sizes), **weights, kv_cache=kv_bytes(sizes),
        sampler_weights=sampler_weight_bytes(config, sizes) + packed,
        activations_no_remat=acts[0], activations_remat=acts[1], remat=config.remat,
        rollout_rows=_static_kv_bytes(config, cache_shape, sizes)[1], cache_length=cache_len, micro_rows=micro_rows,
        train_seq_len=seq_len,
        # int32 prompt/completion tokens and masks, float32 old and reference log-probs, float32 advantages
        batch=divided(minibatch, batch_ways) * (4 * 2 * padded_prompt + 4 * 4 * new_tokens + 4),
        gradient_buffers=2 + (grad_accum > 1), teacher=teacher_bytes, teacher_hidden=teacher_hidden,
        max_staleness=max_staleness,
        weight_copies=(max_staleness + 1) * copy if (max_staleness or own_mesh) else 0,
        sampler_mesh_sizes=mesh_tuple(where) if own_mesh else None,
        sampler_kv_cache=kv_bytes(where) if own_mesh else 0,
        sampler_step_weights=sampler_weight_bytes(config, where) if own_mesh else 0, sequence=sequence,
    )


def longest_context(config: ModelConfig, mesh_sizes: tuple[int, ...], device_memory: int, *, prompt_len: int,
                    multiple: int = 16, limit: int = 1 << 22, **plan_kwargs: Any) -> int:
    """The longest context `prompt_len + new_tokens` (a multiple of `multiple`, at most `limit`) whose step
    `plan_memory(config, mesh_sizes, prompt_len=prompt_len, new_tokens=..., **plan_kwargs)` fits in
    `device_memory` bytes per device; 0 when not even `prompt_len + multiple` fits. Every term of the plan grows
    with the context (the KV cache, the batch and the activations linearly for a fixed query chunk), so the
    largest fitting one is found by bisection."""
    def fits(context: int) -> bool:
        return plan_memory(config, mesh_sizes, prompt_len=prompt_len, new_tokens=context - prompt_len,
                           **plan_kwargs).fits(device_memory)

    low, high = 0, limit // multiple  # contexts of `k * multiple` tokens, past the prompt
    first = -(-(prompt_len + 1) // multiple)
    if not fits(first * multiple):
        return 0
    low = first
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid * multiple):
            low = mid
        else:
            high = mid - 1
    return low * multiple
