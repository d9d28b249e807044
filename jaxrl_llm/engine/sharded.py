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

Several processes (`jax.distributed`): every process deals the same requests to the same shards, runs the shards
whose devices it holds, and the completions are gathered so that every process has them all (`process_allgather`
of their pickled bytes); the weights are first made whole on every device (one all-gather) where they are split
over processes. Sampling thus divides between hosts as it divides between devices. A mesh whose `tensor` axis
spans processes keeps one `Engine` over the whole mesh (every process schedules alike, on the XLA path).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
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
    """Whether an engine on `mesh` runs as one engine per data-parallel shard: a mesh of several batch positions,
    each shard's devices in one process."""
    if mesh is None or mesh.size == mesh.shape["tensor"]:
        return False
    return all(len({d.process_index for d in sub.devices.flat}) == 1 for sub in shard_meshes(mesh))


def _local(sub: Mesh) -> bool:
    return sub.devices.flat[0].process_index == jax.process_index()


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
        pages, shard_slots = max(-(-num_pages // n), min_shard_pages), max(1, -(-slots // n))
        # this process's shards' engines; another process's shards are None here
        self.engines: list[Engine | None] = [
            Engine(config, num_pages=pages, slots=shard_slots, mesh=sub, **engine_kwargs) if _local(sub) else None
            for sub in self.meshes]
        cpu_kernel.sampling_unavailable_reason()  # built here, not by the shards' threads at once
        first = next(e for e in self.engines if e is not None)
        self.page_size, self.attention, self.packed_matmul = first.page_size, first.attention, first.packed_matmul
        self.slots, self.num_pages = shard_slots * n, pages * n
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
        local = [shard for shard, engine in enumerate(self.engines) if engine is not None]
        spans = len({d.process_index for d in self.mesh.devices.flat}) > 1  # the mesh spans several processes
        whole = _whole_everywhere(params, self.mesh) if spans else params

        # Each shard's copy is placed here, before the threads: `device_put`s of one array from several threads at
        # once raced (now and then "safe_zip() argument 1 has length 8 but argument 0 has length 16"); a
        # `device_put` is asynchronous, so doing them in turn costs nothing.
        placed = {shard: _on(whole, self.meshes[shard]) for shard in local if mine[shard]}

        def run(shard: int) -> list[list[Completion]]:
            engine = self.engines[shard]
            if not mine[shard] or engine is None:
                return []
            return engine.generate(placed[shard], [requests[r] for r in mine[shard]], sampling, keep=keep)

        with concurrent.futures.ThreadPoolExecutor(len(local)) as pool:
            done = dict(zip(local, pool.map(run, local), strict=True))
        results: list[list[Completion]] = [[] for _ in requests]
        for shard, out in done.items():
            for r, completions in zip(mine[shard], out, strict=True):
                for c in completions:
                    if c.conversation is not None:
                        c.conversation = ShardedConversation(**vars(c.conversation), shard=shard)
                results[r] = completions
        if spans:  # every process gets the other processes' shards' completions
            results = _gathered(results, [r for shard in local for r in mine[shard]])
        engines = [e for e in self.engines if e is not None]
        self.stats = EngineStats(*(sum(getattr(e.stats, f.name) for e in engines)
                                   for f in dataclasses.fields(EngineStats)))
        return results

    def release(self, conversation: Conversation) -> None:
        """Give a kept conversation's pages back to its shard's pool (another process's shard: that process does)."""
        shard = conversation.shard if isinstance(conversation, ShardedConversation) else 0
        engine = self.engines[shard]
        if engine is not None:
            engine.release(conversation)
        else:
            conversation.pages = []


def _whole_everywhere(params: Params, mesh: Mesh) -> Params:
    """`params` whole on every device of `mesh` (an all-gather where they are split over processes): each shard
    then copies its weights from a device of its own."""
    return jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, PartitionSpec()))(params)


def _on(params: Params, sub: Mesh) -> Params:
    """`params` (whole on the devices of `sub`, or held by this process) as a copy on the shard mesh `sub`."""
    device = sub.devices.flat[0]

    def one(x: jax.Array) -> jax.Array:
        if not x.is_fully_addressable:  # whole on every device: this shard's device holds all of it
            x = next(piece.data for piece in x.addressable_shards if piece.device == device)
        return jax.device_put(x, NamedSharding(sub, PartitionSpec()))

    return jax.tree.map(one, params)


def _gathered(results: list[list[Completion]], mine: list[int]) -> list[list[Completion]]:
    """Every process's results: each sends the completions of its requests `mine` (pickled: lists of varying
    length), and each request's completions are taken from the process that sampled them. Collective: every process
    calls it with the same requests."""
    payload = np.frombuffer(pickle.dumps({r: results[r] for r in mine}), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([payload.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[:payload.size] = payload
    every = multihost_utils.process_allgather(padded)
    out, own = list(results), set(mine)
    for part, size in zip(every, np.asarray(sizes).reshape(-1), strict=True):
        for r, completions in pickle.loads(part[:int(size)].tobytes()).items():
            if r not in own:  # this process's own completions stay the objects its engines hold
                out[r] = completions
    return out
