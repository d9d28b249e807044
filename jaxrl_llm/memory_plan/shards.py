"""Where the planner's arrays live, without devices: a mesh's axis sizes, the shard each device holds under the
partition rules of `jaxrl_llm.sharding` (evaluated on a `jax.sharding.AbstractMesh`), and a pytree's bytes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec

from jaxrl_llm import sharding

P = PartitionSpec
# The sampler's cache `[L, B*n, S, KVH, hd]` (`init_cache`'s layout): rows over the batch axes, KV heads over
# `tensor`; the layer axis stays whole.
KV_CACHE_SPEC = P(None, sharding.BATCH_AXES, None, "tensor", None)


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


def divided(n: int, ways: int) -> int:
    """`n / ways` when `ways` divides `n`, else `n` (the fit rule: a dimension the axis does not divide stays
    replicated)."""
    return n // ways if n % ways == 0 else n


def array_bytes(shape: Sequence[int], dtype: Any) -> int:
    """`prod(shape) * itemsize(dtype)`."""
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def tree_shard_bytes(shapes: Any, specs: Any, axis_sizes: Mapping[str, int], dtype: Any = None) -> int:
    """`sum over leaves of prod(shard_shape(leaf.shape, spec, axis_sizes)) * itemsize(dtype or leaf.dtype)`:
    one device's bytes of a pytree of `ShapeDtypeStruct`s with a matching pytree of `PartitionSpec`s."""
    leaves = jax.tree.leaves(shapes)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if len(leaves) != len(spec_leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(spec_leaves)} specs")
    return sum(
        array_bytes(shard_shape(x.shape, spec, axis_sizes), dtype or x.dtype)
        for x, spec in zip(leaves, spec_leaves, strict=True)
    )


def param_partition_specs(shapes: Any, axis_sizes: Mapping[str, int]) -> Any:
    """`sharding.param_specs` of a parameter pytree for a mesh of these sizes (no devices needed)."""
    return sharding.param_specs(shapes, abstract_mesh(axis_sizes))


