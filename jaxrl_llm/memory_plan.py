"""Per-device memory planner: will this model, mesh and batch fit before anything is allocated or compiled?

    python -m jaxrl_llm plan --model Qwen/Qwen2.5-0.5B --mesh data=1,fsdp=8,tensor=1 --batch 8 --group-size 8 \\
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

Sampling beside training (`rollout.max_staleness` K > 0, docs/overlap.md) runs both at once and keeps up to K + 1
copies of the inference weights (`param_dtype`, placed like the reference) for the sampler. On one mesh:

    peak = params + reference + optimizer + (K + 1) weight copies + KV cache + sampler copy + gradients + activations

With the sampler on devices of its own (`rollout.sampler_devices`), the trainer's devices hold no rollout
(`persistent + update`) and each sampler device holds `(K + 1)` weight copies + its KV cache + its sampler copy,
under the sampler mesh's `(data, 1, tensor)` placement; both must fit.

Not counted: the runtime's own reservation (CUDA context, and on GPUs JAX preallocates 75% of the memory
unless `XLA_PYTHON_CLIENT_MEM_FRACTION` / `XLA_PYTHON_CLIENT_PREALLOCATE` say otherwise: pass the usable
amount as `--device-memory`), the reference model's log-prob pass (a forward only, smaller than the train
step), the prefill's transient `[B, P_b]` cache, rollout arrays, and fragmentation: keep some margin.

`plan_memory` is the pure function; `python -m jaxrl_llm plan` (`jaxrl_llm/cli/plan.py`) is a thin shell around
it that reads a config and prints a table. The optimizer planned is the trainer's own (`make_optimizer`: AdamW with
clipping and the non-finite guard), or any optax transformation passed in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, PartitionSpec

from jaxrl_llm import sharding
from jaxrl_llm.config import OptimSection
from jaxrl_llm.engine.pages import table_width
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import param_shapes
from jaxrl_llm.models.lora import LoraSpec, init_adapters
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.rl.logprobs import logprob_chunk_size

P = PartitionSpec
# The sampler's cache `[L, B*n, S, KVH, hd]` (`init_cache`'s layout): rows over the batch axes, KV heads over
# `tensor`; the layer axis stays whole.
KV_CACHE_SPEC = P(None, sharding.BATCH_AXES, None, "tensor", None)
DEFAULT_MODEL = "models/arith-base"
# The trainer's sampler rounds prompt and completion lengths up to multiples of 16 (trainer.sampling_config).
TRAINER_BUCKET = 16
# Float32 `[rows, chunk, V]` blocks live at once in the log-prob head (measured on XLA:CPU, see activation_bytes).
HEAD_BLOCKS = 3


# ------------------------------------------------------------------------------------------- placement


def axis_sizes_of(mesh_sizes: Sequence[int]) -> dict[str, int]:
    """`{"data": d, "fsdp": f, "expert": e, "tensor": t}` from `(d, f, e, t)` (`sharding.MESH_AXES`' order), or
    from `(d, f, t)` with `e = 1`; every size must be a positive integer."""
    sizes = tuple(int(s) for s in mesh_sizes)
    if len(sizes) == 3:
        sizes = (sizes[0], sizes[1], 1, sizes[2])
    if len(sizes) != len(sharding.MESH_AXES) or any(s < 1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive integers (data, fsdp, expert, tensor), got {mesh_sizes}")
    return dict(zip(sharding.MESH_AXES, sizes, strict=True))


def mesh_tuple(axis_sizes: Mapping[str, int]) -> tuple[int, int, int, int]:
    """`(data, fsdp, expert, tensor)` from `axis_sizes_of`'s mapping."""
    return tuple(int(axis_sizes[a]) for a in sharding.MESH_AXES)  # type: ignore[return-value]


def abstract_mesh(axis_sizes: Mapping[str, int]) -> AbstractMesh:
    """A device-less `(data, fsdp, expert, tensor)` mesh of these sizes: `sharding`'s rules only read its axis sizes."""
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


def trainer_optimizer() -> optax.GradientTransformation:
    """The optimizer the trainers build (`optim.make_optimizer`: global-norm clipping, AdamW, the
    non-finite guard); its state's shapes do not depend on the schedule or the learning rate."""
    return make_optimizer(OptimSection(), total_updates=1)[0]


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
        head      = HEAD_BLOCKS*4*b*c*v + b*T*D*4 + b*T^2
            (the log-probs come from the final hidden states `c` positions at a time, `c` =
            `train_step.logprob_chunk_size(b, C, V, logprob_block_mib)`: HEAD_BLOCKS float32 `[b, c, v]`
            blocks live at once (logits, probabilities, their cotangent); no compute-dtype copy of the output
            matrix lives across the step (the precision policy's dots keep their operands as given and cast
            them again in the backward); a tied embedding is multiplied as stored, so its gradient is the
            embedding's own, no separate `[D, v]` one; final norm; the attention mask)
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
    i = _divided(active_width(config), t)
    v = _divided(config.vocab_size, t)
    q = min(tt, config.attention_query_chunk or tt)
    per_layer = b * tt * (s * (5 * d + 2 * (h + k) * hd + 6 * i) + 4 * 4 * d) + b * h * q * tt * (4 + s)
    per_layer += b * tt * 4 * 2 * config.num_experts  # MoE: the router's float32 logits and probabilities

    chunk = logprob_chunk_size(b, cc, config.vocab_size, logprob_block_mib)
    head = HEAD_BLOCKS * 4 * b * chunk * v + b * tt * d * 4 + b * tt * tt
    gathered = 0
    if axis_sizes["fsdp"] > 1:
        layer_weights = d * (h + 2 * k) * hd + h * hd * d + 3 * d * _divided(stored_width(config), t)
        gathered = 2 * layer_weights * config.jnp_dtype.itemsize
    if remat:
        return config.num_layers * s * b * tt * d + per_layer + head + gathered
    return (config.num_layers + 1) * per_layer + head + gathered


def active_width(config: ModelConfig) -> int:
    """The feed-forward's intermediate columns each token computes: the dense MLP's, or for a mixture of experts
    `k` experts' plus the shared expert's."""
    if not config.is_moe:
        return config.intermediate_size
    return config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size


def stored_width(config: ModelConfig) -> int:
    """The feed-forward's intermediate columns stored per layer: the dense MLP's, or every expert's plus the shared
    expert's (each column a gate, an up and a down vector)."""
    if not config.is_moe:
        return config.intermediate_size
    return config.num_experts * config.moe_intermediate_size + config.shared_expert_intermediate_size


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
    d, hd = config.hidden_size, config.head_dim
    i = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size
    qkv_cols = (config.num_heads + 2 * config.num_kv_heads) * hd
    per_layer = (d + config.qkv_bias) * _divided(qkv_cols, t) + (d + config.mlp_bias) * _divided(2 * i, t)
    copied = config.dtype != config.param_dtype or axis_sizes["fsdp"] > 1
    if copied:
        per_layer += _divided(config.num_heads * hd, t) * d + d * config.o_bias
        per_layer += _divided(i, t) * d + d * config.mlp_bias
        # MoE: the router and every expert's matrices, cast (they are not concatenated: else the parameters)
        per_layer += config.num_experts * (d + 3 * d * _divided(config.moe_intermediate_size, t))
    return config.num_layers * per_layer * s


def packed_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the engine's AMX-packed decode weights (`engine.model.pack_step_weights`, one CPU device): every
    layer's q|k|v, o, gate|up and down and the LM head `[D, V]` in bfloat16, K rounded up to 32 rows and the head's
    columns to 16 (`cpu_kernel.pack_weight`; the layers' widths are whole tiles where they pack)."""
    d, hd = config.hidden_size, config.head_dim
    i = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size  # experts: unpacked
    up32 = lambda k: -(-k // 32) * 32  # noqa: E731
    per_layer = (up32(d) * (config.num_heads + 2 * config.num_kv_heads) * hd + up32(config.num_heads * hd) * d
                 + up32(d) * 2 * i + up32(i) * d)
    return 2 * (config.num_layers * per_layer + up32(d) * -(-config.vocab_size // 16) * 16)


# ------------------------------------------------------------------------------------------------- plan


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


def plan_memory(config: ModelConfig, mesh_sizes: tuple[int, ...], *, batch: int, prompt_len: int,
                new_tokens: int, group_size: int = 1, minibatch: int = 0, grad_accum: int = 1,
                reference: bool = False, optimizer: optax.GradientTransformation | None = None,
                prompt_bucket: int = 1, new_tokens_bucket: int = 1, logprob_block_mib: float = 256.0,
                lora_rank: int = 0, lora_targets: str = "(q|k|v|o|gate|up|down)_proj", engine_page_size: int = 0,
                engine_pages: int = 0, teacher: ModelConfig | None = None, teacher_in_update: bool = False,
                max_tokens_per_microbatch: int = 0, max_staleness: int = 0,
                sampler_mesh_sizes: tuple[int, ...] | None = None, engine_slot_caches: bool = True,
                engine_packed_weights: bool = False) -> MemoryPlan:
    """Per-device memory of an RL step of `config` (its `dtype`, `param_dtype` and `remat` are used) on a
    `(data, fsdp, expert, tensor)` mesh of `mesh_sizes` (or `(data, fsdp, tensor)`), without devices or allocation.

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
    sizes = axis_sizes_of(mesh_sizes)
    rollout_seqs = batch * group_size
    minibatch = minibatch or rollout_seqs
    _check_sizes(batch, group_size, prompt_len, new_tokens, minibatch, grad_accum, prompt_bucket, new_tokens_bucket)
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    weights = _weight_bytes(config, sizes, optimizer, lora_rank, lora_targets)
    padded_prompt = _round_up(prompt_len, prompt_bucket)
    cache_len = padded_prompt + _round_up(new_tokens, new_tokens_bucket)
    cache_shape = (config.num_layers, rollout_seqs, cache_len, config.num_kv_heads, config.head_dim)
    cache_block = shard_shape(cache_shape, fit_spec_sizes(KV_CACHE_SPEC, cache_shape, sizes), sizes)
    kv_cache = 2 * _nbytes(cache_block, config.jnp_dtype)

    def engine_kv(on: dict[str, int]) -> int:
        """The engine's pool and one decode call's slot caches on a device of the mesh `on`: the pool and the slots
        split between the data-parallel shards (`data * fsdp * expert`), KV heads over `tensor` where they divide."""
        kv_heads = _divided(config.num_kv_heads, on["tensor"])
        ps, per_token = engine_page_size, 2 * _nbytes((config.num_layers, kv_heads, config.head_dim), config.jnp_dtype)
        pages = -(-(padded_prompt + new_tokens) // ps)  # one sample's
        shards = on["data"] * on["fsdp"] * on["expert"]
        pool = -(-(engine_pages or batch * (-(-padded_prompt // ps) + group_size * pages) + 1) // shards)
        slot_rows = _divided(rollout_seqs, shards) if engine_slot_caches else 0
        return (pool * ps + slot_rows * table_width(pages, ps) * ps) * per_token

    if engine_page_size:
        kv_cache = engine_kv(sizes)

    micro_rows = _divided(minibatch // grad_accum, batch_ways)
    if max_tokens_per_microbatch:
        packed_len = padded_prompt + new_tokens - 1
        rows = min(minibatch, -(-11 * -(-max_tokens_per_microbatch // packed_len) // 9) + 1)
        micro_rows = _divided(rows, batch_ways)
    seq_len = padded_prompt + new_tokens - 1
    acts = [activation_bytes(config, micro_rows, seq_len, new_tokens, sizes, remat=remat,
                             logprob_block_mib=logprob_block_mib) for remat in (False, True)]
    # int32 prompt/completion tokens and masks, float32 old and reference log-probs, float32 advantages.
    batch_bytes = _divided(minibatch, batch_ways) * (4 * 2 * padded_prompt + 4 * 4 * new_tokens + 4)
    teacher_bytes = teacher_hidden = 0
    if teacher is not None:
        shapes = param_shapes(teacher)
        teacher_bytes = tree_shard_bytes(shapes, param_partition_specs(shapes, sizes), sizes)
        if teacher_in_update:
            teacher_hidden = micro_rows * seq_len * teacher.hidden_size * 4
    where = axis_sizes_of(sampler_mesh_sizes) if sampler_mesh_sizes is not None else sizes
    shapes = param_shapes(config)
    copy = tree_shard_bytes(shapes, param_partition_specs(shapes, where), where)
    copies = (max_staleness + 1) * copy if (max_staleness or sampler_mesh_sizes is not None) else 0
    sampler_kv = sampler_step = 0
    if sampler_mesh_sizes is not None:
        sampler_block = shard_shape(cache_shape, fit_spec_sizes(KV_CACHE_SPEC, cache_shape, where), where)
        sampler_kv = engine_kv(where) if engine_page_size else 2 * _nbytes(sampler_block, config.jnp_dtype)
        sampler_step = sampler_weight_bytes(config, where)
    return MemoryPlan(
        max_staleness=max_staleness,
        weight_copies=copies,
        sampler_mesh_sizes=None if sampler_mesh_sizes is None else mesh_tuple(where),
        sampler_kv_cache=sampler_kv,
        sampler_step_weights=sampler_step,
        teacher=teacher_bytes,
        teacher_hidden=teacher_hidden,
        mesh_sizes=mesh_tuple(sizes),
        num_params=weights["num_params"],
        params=weights["params"],
        reference=weights["reference"] if reference else 0,
        merged=weights["merged"],
        trainable=weights["trainable"],
        optimizer=weights["optimizer"],
        gradients=weights["gradients"],
        kv_cache=kv_cache,
        sampler_weights=sampler_weight_bytes(config, sizes) + (packed_weight_bytes(config)
                                                               if engine_packed_weights else 0),
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
