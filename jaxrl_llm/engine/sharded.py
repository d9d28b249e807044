"""The rollout engine on a mesh of several devices: one `Engine` per data-parallel shard, as vLLM and SGLang run one
engine per data-parallel rank.

    requests ──dealt by tokens──> shard 0: Engine(its devices: the mesh's `tensor` axis at one batch position)
                                  shard 1: Engine(...)            each: its own slots, page pool, page tables,
                                  ...                             programs and kernels
    results <──── in request order ──────┘

The mesh's batch axes (`data`, `fsdp`, `expert`) index the shards; each shard is the `tensor` devices at one
position of them (one device where `tensor` is 1). A shard's engine holds `1 / shards` of the slots and of the
page pool, and runs on its own devices with its own kernels: the C++ attention kernel (and the AMX matmul) on a CPU
device, Pallas on a GPU or TPU; a shard of several `tensor` devices splits its KV heads over them and decodes on the
XLA path, as a one-device engine's mesh does. Requests are dealt whole (a group's samples stay with the pages of
their prompt) to the shard with the fewest tokens so far (`n x (context + token limit)`), the shards' host loops
run in threads (JAX releases the interpreter while a device computes), and a conversation kept for its next turn
goes back to the shard whose pool holds it. Each sample's randomness is its own (`fold_in(request key, sample)`
and its position), so the tokens are the one-device engine's whatever the dealing.

A mesh that spans several processes keeps one `Engine` over the whole mesh (every process schedules alike).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.scheduler import Completion, Conversation, Engine, EngineStats, Request
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling.config import SamplingConfig
from jaxrl_llm.sharding import MESH_AXES


def shard_meshes(mesh: Mesh) -> list[Mesh]:
    """`mesh`'s data-parallel shards: one sub-mesh per position of its batch axes, holding that position's `tensor`
    devices, with every axis of `MESH_AXES` (sizes `(1, 1, 1, tensor)`)."""
    tensor = mesh.shape["tensor"]
    devices = np.asarray(mesh.devices).reshape(-1, tensor)  # MESH_AXES order: tensor is the last axis
    return [Mesh(row.reshape(1, 1, 1, tensor), MESH_AXES) for row in devices]


def shards_locally(mesh: Mesh | None) -> bool:
    """Whether an engine on `mesh` runs as one engine per data-parallel shard: a mesh of several batch positions
    whose devices this process holds."""
    if mesh is None or mesh.size == mesh.shape["tensor"]:
        return False
    return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


@dataclasses.dataclass
class ShardedConversation(Conversation):
    """A conversation kept in shard `shard`'s pool."""

    shard: int = 0


class ShardedEngine:
    """`Engine`'s `generate` and `release` over the data-parallel shards of `mesh` (module docstring): `num_pages`
    and `slots` in all, split evenly between the shards (each pool at least `min_shard_pages`, what the largest
    request needs); other keywords as `Engine`'s."""

    def __init__(self, config: ModelConfig, *, num_pages: int, slots: int, mesh: Mesh, min_shard_pages: int = 0,
                 **engine_kwargs: Any) -> None:
        self.config, self.mesh = config, mesh
        self.meshes = shard_meshes(mesh)
        n = len(self.meshes)
        pages = max(-(-num_pages // n), min_shard_pages)
        self.engines = [Engine(config, num_pages=pages, slots=max(1, -(-slots // n)), mesh=sub, **engine_kwargs)
                        for sub in self.meshes]
        cpu_kernel.sampling_unavailable_reason()  # built here, not by the shards' threads at once
        first = self.engines[0]
        self.page_size, self.attention, self.packed_matmul = first.page_size, first.attention, first.packed_matmul
        self.slots, self.num_pages = sum(e.slots for e in self.engines), sum(e.num_pages for e in self.engines)
        self.stats = EngineStats()
        self.dealt: list[int] = []  # the shard each request of the last `generate` went to

    def deal(self, requests: list[Request], sampling: SamplingConfig) -> list[int]:
        """Each request's shard: a kept conversation's own, else the shard with the fewest tokens so far (each
        request weighs `n x (its context + its token limit)`), in request order."""
        load = [0] * len(self.engines)
        shards = []
        for req in requests:
            context = len(req.tokens) + (len(req.conversation.tokens) if req.conversation is not None else 0)
            weight = req.n * (context + (req.max_new_tokens or sampling.max_new_tokens))
            if isinstance(req.conversation, ShardedConversation):
                shard = req.conversation.shard
            else:
                shard = min(range(len(load)), key=lambda s: (load[s], s))
            load[shard] += weight
            shards.append(shard)
        return shards

    def generate(self, params: Params, requests: list[Request], sampling: SamplingConfig, *,
                 keep: bool = False) -> list[list[Completion]]:
        """`Engine.generate` over the shards: each shard's requests through its engine (its weights a copy on its
        devices), the completions back in request order."""
        self.dealt = self.deal(requests, sampling)
        mine = [[r for r, s in enumerate(self.dealt) if s == shard] for shard in range(len(self.engines))]

        def run(shard: int) -> list[list[Completion]]:
            if not mine[shard]:
                return []
            engine, sub = self.engines[shard], self.meshes[shard]
            placed = jax.device_put(params, NamedSharding(sub, PartitionSpec()))
            return engine.generate(placed, [requests[r] for r in mine[shard]], sampling, keep=keep)

        with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
            done = list(pool.map(run, range(len(self.engines))))
        results: list[list[Completion]] = [[] for _ in requests]
        for shard, (indices, out) in enumerate(zip(mine, done, strict=True)):
            for r, completions in zip(indices, out, strict=True):
                for c in completions:
                    if c.conversation is not None:
                        c.conversation = ShardedConversation(**vars(c.conversation), shard=shard)
                results[r] = completions
        self.stats = EngineStats(*(sum(getattr(e.stats, f.name) for e in self.engines)
                                   for f in dataclasses.fields(EngineStats)))
        return results

    def release(self, conversation: Conversation) -> None:
        """Give a kept conversation's pages back to its shard's pool."""
        shard = conversation.shard if isinstance(conversation, ShardedConversation) else 0
        self.engines[shard].release(conversation)
