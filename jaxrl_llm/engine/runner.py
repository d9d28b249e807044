"""The rollout engine's device side: its page pool and the programs over it (`programs.py`), on one device or a mesh.

The host loop (`scheduler.Engine`) hands it numpy arrays (token chunks, positions, page tables, slot states) and
gets numpy arrays back (logits, emitted tokens, their log-probs, routed experts); it owns nothing else of the run.
Which attention and matmuls its programs use is chosen once here (`kernels.attention_backend`): on the CPU the C++
attention kernel, and for a bfloat16 model on a CPU with AMX the packed matmul (`packed_matmul`); `xla` on an
engine of several devices.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.kernels import attention_backend
from jaxrl_llm.engine.pages import PagedLayer, init_pages
from jaxrl_llm.engine.programs import (
    SamplingFlags,
    SlotState,
    StepOutputs,
    copy_pages_program,
    decode_program,
    pack_weights,
    prefill_program,
    prepare_weights,
)
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling.config import Knobs
from jaxrl_llm.sharding import fit_spec, global_array


class CallWeights(NamedTuple):
    """One generate call's weights: the prefill's fused per-layer weights, the decode step's (the same, or packed
    for the AMX matmul), and the packed LM head the prefill shares (None without packing)."""

    prefill: Any
    decode: Any
    head: jax.Array | None


def host_array(x: jax.Array) -> np.ndarray:
    """An array that is whole on every device (a program's output; a run's key) on the host: one addressable copy
    is all of it, also when other processes hold the rest of the mesh."""
    return np.asarray(x) if x.is_fully_addressable else np.asarray(x.addressable_data(0))


class Runner:
    """The page pool of `num_pages` pages of `page_size` tokens and the programs over it. `attention`: `auto | xla
    | cpu | pallas`; on a `mesh` of several devices the pool's KV heads are split over `tensor`, every device holds
    every page, the slots are split over the batch axes and the decode runs on the XLA path."""

    def __init__(self, config: ModelConfig, *, num_pages: int, page_size: int, attention: str = "auto",
                 mesh: Mesh | None = None) -> None:
        self.config, self.page_size, self.mesh = config, page_size, mesh
        if config.is_hybrid:
            raise ConfigError("the rollout engine pages keys and values only and holds no linear-attention state yet; "
                              "sample this hybrid model with sampling.engine=static")
        several = mesh is not None and mesh.size > 1
        if several and attention == "pallas":
            raise ConfigError(f"sampling.engine_attention=pallas runs on one device; this sampler's mesh has "
                              f"{mesh.size}: use auto or xla")  # type: ignore[union-attr]
        self.attention = "xla" if several else attention_backend(config, attention)
        # The AMX matmul goes with the CPU kernels (`engine_attention=xla` turns both off), for bfloat16 models.
        self.packed_matmul = (self.attention == "cpu" and config.jnp_dtype == jnp.bfloat16
                              and cpu_kernel.packed_matmul_unavailable_reason() is None)
        self.pages: list[PagedLayer] = self._placed(lambda: init_pages(config, num_pages, page_size))

    def _placed(self, make: Any) -> Any:
        """`make()`'s arrays created in place on the mesh (the pool's placement), or as they are without one."""
        if self.mesh is None:
            return make()
        shapes = jax.eval_shape(make)
        shardings = jax.tree.map(lambda x: NamedSharding(self.mesh, fit_spec(PartitionSpec("tensor"), x.shape,
                                                                            self.mesh)), shapes)
        return jax.jit(make, out_shardings=shardings)()

    def put(self, x: np.ndarray) -> jax.Array:
        """A host array as a program input: whole on every device of the mesh (every process holds it), or as is."""
        return jnp.asarray(x) if self.mesh is None else global_array(x, self.mesh, PartitionSpec())

    def weights(self, params: Params) -> CallWeights:
        """The call's weights, made once per generate call."""
        weights = prepare_weights(params, self.config, self.mesh)
        if not self.packed_matmul:
            return CallWeights(weights, weights, None)
        packed = pack_weights(params, weights, config=self.config)
        return CallWeights(weights, packed, packed.head)  # the packed LM head serves the prefill too

    def prefill(self, params: Params, weights: CallWeights, tokens: np.ndarray, positions: np.ndarray,
                table: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """A prefill call (`programs.prefill_program`): the logits at each row's column `last` `[R, V]` and an MoE
        model's routed experts `[R, C, L, k]` (else None), on the host; the pages written."""
        out, self.pages, chosen = prefill_program(params, weights.prefill, self.pages,
                                                  *map(self.put, (tokens, positions, table, last)),
                                                  config=self.config, attention=self.attention, mesh=self.mesh,
                                                  head=weights.head)
        return host_array(out), None if chosen is None else host_array(chosen)

    def copy(self, pairs: list[tuple[int, int]], width: int) -> None:
        """Copy pages `source -> target` (`pairs`), in one call of `width` copies (the rest no-op copies of page 0)."""
        source, target = np.zeros((width,), np.int32), np.zeros((width,), np.int32)
        source[:len(pairs)], target[:len(pairs)] = zip(*pairs, strict=True)
        self.pages = copy_pages_program(self.pages, self.put(source), self.put(target))

    def decode(self, params: Params, weights: CallWeights, state: SlotState, knobs: Knobs, flags: SamplingFlags,
               steps: int) -> tuple[np.ndarray, np.ndarray, StepOutputs]:
        """A decode call of `steps` steps over the slots `state` (numpy): each slot's completion index and whether
        it still decodes after the call, and what it emitted (`StepOutputs`, numpy), on the host."""
        placed = SlotState(*map(self.put, state))
        new, out, self.pages = decode_program(params, weights.decode, self.pages, placed, knobs, config=self.config,
                                              flags=flags, steps=steps, attention=self.attention, mesh=self.mesh)
        emitted = StepOutputs(*(None if x is None else host_array(x) for x in out))
        return host_array(new.index), host_array(new.active), emitted
