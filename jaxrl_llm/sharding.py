"""Where arrays live: a `(data, fsdp, expert, sequence, tensor)` device mesh and partition rules by parameter path.

- `data`: pure data parallelism (parameters replicated along it);
- `fsdp`: the batch is split along it too, and parameters and optimizer state are sharded along it
  (ZeRO-3 / FSDP: XLA all-gathers a weight where it is used and reduce-scatters its gradient);
- `expert`: expert parallelism: a mixture of experts' expert weights are split along it (each device holds
  `E / expert` whole experts), and the batch too, so outside the MoE layers it is one more data axis; an MoE layer
  gathers its group's tokens, runs its own experts on the ones routed to them and sums the shares back
  (`models/moe.experts_parallel`). A dense model treats it as data parallelism;
- `sequence`: context parallelism: one sequence's positions split over it. Parameters and rows are replicated along
  it; the training forward's activations `[B, T, D]` are split on `T` (`ModelConfig.sequence_mesh`), and attention
  crosses the shards (`models/sequence_parallel.py`). Anything that is not told about it (the sampler, the reward
  model) sees one more axis its arrays are replicated along;
- `tensor`: Megatron-style tensor parallelism: attention heads (q/k/v columns, o rows) and the MLP's
  intermediate dimension (gate/up columns, down rows), plus the vocabulary of the embedding and LM head.

The batch axis of every activation is split over `("data", "fsdp", "expert")`; the KV cache over the batch and its
key/value heads (`tensor`). `jax.jit` with these shardings inserts every collective, so the math (and the
results, up to float reassociation) does not depend on the mesh: tests check one train step and greedy
sampling on several meshes against one device.

A rule names the mesh axis for each array dimension; an axis whose size does not divide that dimension is
dropped (the dimension stays replicated), so any model runs on any mesh, just less sharded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The axes that partition rules, row specs and the planner's meshes name (a sampler's sub-mesh has exactly these).
MESH_AXES = ("data", "fsdp", "expert", "tensor")
SEQUENCE_AXIS = "sequence"
# The axes of a mesh `make_mesh` builds: `MESH_AXES` with `sequence` next to `tensor`, so a sequence group is
# neighbouring devices too (its all-gathers stay inside a node); a size-1 axis changes no placement.
DEVICE_AXES = ("data", "fsdp", "expert", SEQUENCE_AXIS, "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
P = PartitionSpec

# (regex searched in the "/"-joined parameter path, spec). First match wins. Decoder params are stacked
# over layers, so layer weights have a leading replicated `L` dimension. Kernels are `[in, out]`.
PARTITION_RULES: tuple[tuple[str, PartitionSpec], ...] = (
    (r"embed/embedding$", P("tensor", "fsdp")),  # [V, D]
    (r"layers/attn/(q|k|v)/kernel$", P(None, "fsdp", "tensor")),  # [L, D, heads * hd]
    (r"layers/attn/(q|k|v)/bias$", P(None, "tensor")),  # [L, heads * hd]
    (r"layers/attn/o/kernel$", P(None, "tensor", "fsdp")),  # [L, H * hd, D]
    (r"layers/mlp/(gate|up)/kernel$", P(None, "fsdp", "tensor")),  # [L, D, I]
    (r"layers/mlp/(gate|up)/bias$", P(None, "tensor")),  # [L, I]
    (r"layers/mlp/down/kernel$", P(None, "tensor", "fsdp")),  # [L, I, D]
    (r"layers/(attn/o|mlp/down)/bias$", P()),  # [L, D]
    (r"layers/attn/sinks$", P(None, "tensor")),  # [L, H] (gpt-oss)
    (r"layers/mlp/router/kernel$", P(None, "fsdp", None)),  # [L, D, E]
    (r"layers/mlp/router/bias$", P()),  # [L, E] (gpt-oss)
    (r"layers/mlp/experts/(gate|up)/kernel$", P(None, "expert", "fsdp", "tensor")),  # [L, E, D, I]
    (r"layers/mlp/experts/down/kernel$", P(None, "expert", "tensor", "fsdp")),  # [L, E, I, D]
    (r"layers/mlp/experts/(gate|up)/bias$", P(None, "expert", "tensor")),  # [L, E, I] (gpt-oss)
    (r"layers/mlp/experts/down/bias$", P(None, "expert", None)),  # [L, E, D] (gpt-oss)
    (r"layers/mlp/shared/(gate|up)/kernel$", P(None, "fsdp", "tensor")),  # [L, D, I_shared]
    (r"layers/mlp/shared/down/kernel$", P(None, "tensor", "fsdp")),  # [L, I_shared, D]
    (r"layers/mlp/shared_gate/kernel$", P(None, "fsdp", None)),  # [L, D, 1]
    # Gated DeltaNet (Qwen3.5), [L_linear, ...]: split over fsdp only; q|k|v share one projection whose columns a
    # tensor split would cut across the three (tensor parallelism for these layers is left to GSPMD's choice)
    (r"layers/linear_attn/in_(qkv|z|b|a)/kernel$", P(None, "fsdp", None)),  # [L, D, n]
    (r"layers/linear_attn/out/kernel$", P(None, None, "fsdp")),  # [L, Vd, D]
    (r"layers/linear_attn/(conv/kernel|A_log|dt_bias)$", P()),  # [L, K, 1, C], [L, Hv]
    (r"norm/scale$", P()),  # RMSNorm scales [L, D] / [L, hd] / [D]
    (r"lm_head/kernel$", P("fsdp", "tensor")),  # [D, V]
    (r"(value_head|score)/kernel$", P("fsdp", None)),  # [D, 1] / [D, labels]
    (r"^score$", P("fsdp", None)),  # the reward model's bare score matrix [D, 1]
    (r"(value_head|score)/bias$", P()),
    (r"/lora_(a|b)$", P()),  # LoRA factors [L, in, r] / [L, r, out]: rank-r, small next to the base
)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; one of them may be -1 (all remaining devices). `expert` and `sequence` are
    keyword-only, so that `MeshShape(data, fsdp, tensor)` reads as it always did; `resolve` returns the sizes of
    `MESH_AXES` (sequence left out: what rules and row specs see), `sizes` all of `DEVICE_AXES`."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = dataclasses.field(default=1, kw_only=True)
    sequence: int = dataclasses.field(default=1, kw_only=True)

    def sizes(self, num_devices: int) -> tuple[int, int, int, int, int]:
        """`(data, fsdp, expert, sequence, tensor)` sizes whose product is `num_devices`."""
        sizes = [self.data, self.fsdp, self.expert, self.sequence, self.tensor]
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh {self}: each axis is a positive size, and at most one is -1")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh {self}: {num_devices} devices are not divisible by {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh {self} has data*fsdp*expert*sequence*tensor = {math.prod(sizes)} devices, but {num_devices} "
                "are available")
        return sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]

    def resolve(self, num_devices: int) -> tuple[int, int, int, int]:
        """`(data, fsdp, expert, tensor)` sizes (`MESH_AXES`' order) whose product times `sequence` is
        `num_devices`."""
        data, fsdp, expert, _, tensor = self.sizes(num_devices)
        return data, fsdp, expert, tensor


def make_mesh(shape: MeshShape | Sequence[int] = MeshShape(), devices: Sequence[Any] | None = None) -> Mesh:
    """A `(data, fsdp, expert, sequence, tensor)` mesh (`DEVICE_AXES`) over `devices` (default: all devices of all
    processes); `shape` a `MeshShape`, or sizes `(data, fsdp, tensor)`, `(data, fsdp, expert, tensor)` or
    `(data, fsdp, expert, sequence, tensor)`.

    `tensor` is the fastest-varying axis, so tensor-parallel groups are neighbouring devices (one node's
    NVLink domain on GPUs), then `sequence`; `data` the slowest, so it is the axis that crosses hosts.
    """
    devices = list(devices if devices is not None else jax.devices())
    if not isinstance(shape, MeshShape):  # MESH_AXES' or DEVICE_AXES' order, or the short (data, fsdp, tensor)
        sizes = tuple(shape)
        if len(sizes) == 5:
            shape = MeshShape(sizes[0], sizes[1], sizes[4], expert=sizes[2], sequence=sizes[3])
        elif len(sizes) == 4:
            shape = MeshShape(sizes[0], sizes[1], sizes[3], expert=sizes[2])
        else:
            shape = MeshShape(*sizes)
    return Mesh(np.asarray(devices).reshape(shape.sizes(len(devices))), DEVICE_AXES)


def split_devices(sampler_devices: int) -> tuple[list[Any], list[Any]]:
    """`(trainer's devices, sampler's devices)`: the last `sampler_devices` of `jax.devices()` sample (`rollout.
    sampler_devices`; 0: the trainer's are all, the sampler has none of its own)."""
    devices = list(jax.devices())
    cut = len(devices) - sampler_devices
    return devices[:cut], devices[cut:]


def sampler_mesh(devices: Sequence[Any], tensor: int = 1) -> Mesh:
    """The sampler's own mesh: `tensor` of its devices split each weight matrix (the tensor axis, as the trainer's
    rules place it), the rest split the rows (the data axis); `tensor=1` replicates the weights."""
    if len(devices) % tensor:
        raise ValueError(f"the sampler's {len(devices)} device(s) do not split into tensor groups of {tensor}")
    return make_mesh(MeshShape(len(devices) // tensor, 1, tensor), devices)


def expert_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh` if its `expert` axis splits anything (size > 1), else None: what `ModelConfig.expert_mesh` holds."""
    return mesh if mesh is not None and mesh.shape.get("expert", 1) > 1 else None


def sequence_mesh(mesh: Mesh | None) -> Mesh | None:
    """`mesh` if it has a `sequence` axis that splits anything (size > 1), else None: what
    `ModelConfig.sequence_mesh` holds."""
    return mesh if mesh is not None and mesh.shape.get(SEQUENCE_AXIS, 1) > 1 else None


def mesh_of(tree: Any, default: Mesh | None) -> Mesh | None:
    """The mesh `tree`'s first array is placed on (a `NamedSharding`'s), else `default`."""
    leaves = jax.tree.leaves(tree)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    return sharding.mesh if isinstance(sharding, NamedSharding) else default


def _axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in names)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """`spec` for an array of `shape`, with every axis that does not divide its dimension dropped."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if len(entries) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the array's shape {tuple(shape)}")
    fitted = []
    for dim, axes in zip(shape, entries, strict=True):
        fitted.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return P(*fitted)


def path_string(path: tuple[Any, ...]) -> str:
    """`"layers/attn/q/kernel"` from a `jax.tree_util` key path."""
    parts = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry)))
        parts.append(str(key))
    return "/".join(parts)


def param_spec(path: str, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """The rule's spec for the parameter at `path` (fitted to `shape`); unknown paths are an error, so a new
    parameter cannot silently end up replicated on every device."""
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, path):
            return fit_spec(spec, shape, mesh)
    raise ValueError(f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); add one to "
                     "jaxrl_llm.sharding.PARTITION_RULES")


def param_specs(params: Any, mesh: Mesh) -> Any:
    """A pytree of `PartitionSpec`s for `params` (arrays or `ShapeDtypeStruct`s)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_spec(path_string(p), x.shape, mesh), params)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree of `NamedSharding`s for `params` by `PARTITION_RULES`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh))


def optimizer_state_shardings(optimizer: optax.GradientTransformation, opt_state: Any, params_shardings: Any,
                              mesh: Mesh) -> Any:
    """Shardings of `opt_state` (arrays or shapes): every copy of the parameter tree inside it (Adam's `mu`,
    `nu`) sharded like the parameters, everything else (step counts, flags) replicated."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, s: s, opt_state, params_shardings, transform_non_params=lambda _: replicated,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """For every per-sequence array `[N, ...]`: rows split over `data` x `fsdp` x `expert`."""
    return NamedSharding(mesh, P(BATCH_AXES))


def batch_divisor(mesh: Mesh) -> int:
    """How many ways the batch is split: `data * fsdp * expert`."""
    return _axis_size(mesh, BATCH_AXES)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """`params` placed on `mesh` by the rules (each device keeps only its shard)."""
    return jax.device_put(params, param_shardings(params, mesh))


def constrain(x: jax.Array, mesh: Mesh | None, spec: PartitionSpec) -> jax.Array:
    """`with_sharding_constraint` to `spec` fitted to `x`'s shape; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit_spec(spec, x.shape, mesh)))


def local_bytes(tree: Any) -> int:
    """Bytes of `tree`'s arrays held by the first addressable device (one device's share)."""
    device = jax.local_devices()[0]
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def global_array(x: Any, mesh: Mesh, spec: PartitionSpec | None = None) -> jax.Array:
    """A global `jax.Array` placed by `spec` (fitted to `x`'s shape; default: rows over `BATCH_AXES`)
    from a host array that every process holds in full; each device receives only its own slice."""
    x = np.asarray(x)
    spec = P(BATCH_AXES) if spec is None else spec
    sharding = NamedSharding(mesh, fit_spec(spec, x.shape, mesh))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(tree: Any) -> Any:
    """Every array of `tree` as a full numpy array on every process (an all-gather across hosts)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)

    return jax.tree.map(
        lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", True) else
        np.asarray(multihost_utils.process_allgather(x, tiled=True)),
        tree,
    )


def process_rows(num_rows: int) -> slice:
    """The rows of a global batch this process owns (its contiguous share, process-major)."""
    count, index = jax.process_count(), jax.process_index()
    if num_rows % count:
        raise ValueError(f"a batch of {num_rows} rows cannot be split evenly over {count} processes")
    share = num_rows // count
    return slice(index * share, (index + 1) * share)


def train_state_shardings(optimizer: optax.GradientTransformation, params: Any, params_sharding: Any,
                          mesh: Mesh) -> dict[str, Any]:
    """The placement of a train state `{"params", "opt_state"}` from the parameters' shapes alone (arrays or
    `ShapeDtypeStruct`s): what an update's jit is given, with no optimizer state built to read it from."""
    shapes = jax.eval_shape(optimizer.init, params)
    return {"params": params_sharding, "opt_state": optimizer_state_shardings(optimizer, shapes, params_sharding, mesh)}


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any, params_sharding: Any,
                         mesh: Mesh) -> Any:
    """`optimizer.init(params)` created directly in its shards (see `optimizer_state_shardings`)."""
    shapes = jax.eval_shape(optimizer.init, params)
    shardings = optimizer_state_shardings(optimizer, shapes, params_sharding, mesh)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def initialize_distributed(enabled: bool = False, coordinator_address: str = "", num_processes: int = 0,
                           process_id: int = -1, local_device_ids: Sequence[int] = ()) -> bool:
    """`jax.distributed.initialize` for a multi-process run; returns whether it was called.

    Runs when `enabled`, when a coordinator address is given, or when `JAX_COORDINATOR_ADDRESS` is set.
    Empty arguments come from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, else JAX's
    cluster auto-detection (SLURM, Open MPI, TPU pods).
    Must run before anything queries the devices. On CPU (tests) it also selects gloo collectives.
    """

    if not (enabled or coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return False
    kwargs: dict[str, Any] = {}
    num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
    process_id = process_id if process_id >= 0 else int(os.environ.get("JAX_PROCESS_ID", "-1"))
    if coordinator_address:
        kwargs["coordinator_address"] = coordinator_address
    if num_processes > 0:
        kwargs["num_processes"] = num_processes
    if process_id >= 0:
        kwargs["process_id"] = process_id
    if local_device_ids:
        kwargs["local_device_ids"] = list(local_device_ids)
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
