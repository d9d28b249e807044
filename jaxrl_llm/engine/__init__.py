"""The rollout engine: continuous batching over a paged KV cache, a group's prompt prefilled once and shared,
conversations kept across turns (docs/engine.md).

- `pages.py`: the paged KV cache as pure functions; `allocator.py`: free pages and reference counts (host);
- `model.py`: the decoder's block over pages; `programs.py`: the jitted prefill and decode programs;
- `scheduler.py`: `Engine`, admission, prefill, fork, decode slots (host);
- `engine_sample`: the static sampler's interface (`SampleOutput`) on top of an `Engine`; `PagedSampler`: that
  interface with the engine sized per call (what a run and `python -m jaxrl_llm.eval/generate --engine paged` use);
  `LongContextHandover`: a longrope model's calls past its original context to the static sampler, the one place
  that choice is made (`make_sampler`), said in the run's header.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.engine.kernels import describe_paths
from jaxrl_llm.engine.model import engine_context_problem
from jaxrl_llm.engine.pages import default_page_size
from jaxrl_llm.engine.scheduler import Completion, Conversation, Engine, EngineStats, Request, host_array
from jaxrl_llm.engine.sharded import ShardedEngine, shards_locally
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import longrope_original
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.moe import NO_RECORD
from jaxrl_llm.sampling import Sampler, StaticSampler
from jaxrl_llm.sampling.config import SampleOutput, SamplingConfig
from jaxrl_llm.sampling.options import SAMPLERS
from jaxrl_llm.sampling.padding import right_pad
from jaxrl_llm.sharding import mesh_of

__all__ = ["Completion", "Conversation", "Engine", "EngineStats", "LongContextHandover", "PagedSampler", "Request",
           "SAMPLERS", "Sampler",
           "ShardedEngine", "engine_sample", "make_sampler", "row_keys", "sample_output"]


def row_keys(key: jax.Array, rows: int) -> np.ndarray:
    """`fold_in(key, r)` for `r < rows` as key data `[rows, 2]` (uint32, numpy: what a `Request` takes), in one
    device call rather than one per row; `key` may be a run's key placed on a mesh of several processes."""
    key = jax.random.wrap_key_data(host_array(jax.random.key_data(key)))  # this process's copy
    return np.asarray(jax.random.key_data(jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))))


def prompt_requests(prompt_tokens: Any, prompt_mask: Any, key: jax.Array, sampling: SamplingConfig
                    ) -> list[Request]:
    """One request per row of a left-padded prompt batch `[B, P]` (its tokens under the mask), keyed
    `fold_in(key, row)`, with `sampling.n` samples."""
    tokens, mask = np.asarray(prompt_tokens), np.asarray(prompt_mask).astype(bool)
    keys = row_keys(key, tokens.shape[0])
    return [Request(tokens[b][mask[b]].tolist(), keys[b], n=sampling.n) for b in range(tokens.shape[0])]


def sample_output(completions: list[Completion], columns: int, pad_id: int,
                  prompt_lengths: list[int] | None = None, prompt_width: int = 0) -> SampleOutput:
    """Completions as the static sampler's right-padded `SampleOutput` `[N, columns]` (numpy). For an MoE model
    (completions with `experts`) and `prompt_lengths` (each row's prompt), `routing [N, prompt_width + columns, L,
    k]`: the experts of each prompt token right-aligned in the first `prompt_width` columns (a left-padded prompt's
    place), then each fed completion token's (`moe.NO_RECORD` elsewhere)."""
    n = len(completions)
    tokens, mask = right_pad([c.tokens for c in completions], columns, pad_id)
    logprobs, untruncated = (right_pad([getattr(c, name) for c in completions], columns, dtype=np.float32)[0]
                             for name in ("logprobs", "untruncated"))
    routing = None
    if prompt_lengths is not None and completions and completions[0].experts is not None:
        routing = np.full((n, prompt_width + columns, *completions[0].experts.shape[1:]), NO_RECORD, np.int16)
        for r, (c, p) in enumerate(zip(completions, prompt_lengths, strict=True)):
            assert c.experts is not None
            routing[r, prompt_width - p:prompt_width] = c.experts[:p]
            fed = c.experts[p:p + columns]
            routing[r, prompt_width:prompt_width + len(fed)] = fed
    return SampleOutput(tokens, mask, logprobs, untruncated, mask.sum(axis=1).astype(np.int32),
                        np.asarray([c.stopped_on_eos for c in completions], bool), routing)


def engine_sample(engine: Engine | ShardedEngine, params: Params, config: ModelConfig, prompt_tokens: Any,
                  prompt_mask: Any, key: jax.Array, sampling: SamplingConfig) -> SampleOutput:
    """`sampling.n` completions of each prompt of a left-padded batch through `engine`: the static sampler's
    `sample` (same arguments, prompt-major rows, `max_new_tokens` columns), with each row's randomness its own."""
    del config  # the engine's
    requests = prompt_requests(prompt_tokens, prompt_mask, key, sampling)
    results = engine.generate(params, requests, sampling)
    lengths = [len(r.tokens) for r in requests for _ in range(r.n)]
    return sample_output([c for group in results for c in group], sampling.max_new_tokens, sampling.pad_id, lengths,
                         np.shape(prompt_tokens)[1])




def make_sampler(name: str, config: ModelConfig, *, page_size: int = 0, slots: int = 0, steps_per_call: int = 16,
                 pages: int = 0, attention: str = "auto") -> Sampler:
    """The sampler `sampling.engine` names, the one place a name becomes a sampler: `paged`, the rollout engine
    (`PagedSampler`, with the `sampling.engine_*` settings; for a longrope model, inside `LongContextHandover`),
    or `static` (`StaticSampler`). A hybrid stack (linear-attention layers) gets the static sampler, which says
    why in the run header."""
    if name == "paged" and config.is_hybrid:
        return StaticSampler(config, "sampling.engine: paged asked for, but the rollout engine holds no "
                                     "linear-attention state yet")
    if name == "paged":
        paged = PagedSampler(config, page_size=page_size, slots=slots, steps_per_call=steps_per_call, pages=pages,
                             attention=attention)
        return LongContextHandover(paged, StaticSampler(config)) if longrope_original(config) is not None else paged
    if name == "static":
        return StaticSampler(config)
    raise ValueError(f"unknown sampler {name!r}; expected one of {', '.join(SAMPLERS)}")


class PagedSampler:
    """The static sampler's call, `(params, tokens, mask, key, sampling) -> SampleOutput`, through a rollout engine
    whose pool fits each call: `page_size` tokens a page, `slots` decoding at once (0: every row of the call),
    `steps_per_call` decode steps a device call, `pages` in the pool (0: what the call's rows need at their token
    limit, each prompt counted once per group), `attention` the decode step's (`auto | xla | pallas`). The engine is
    made anew only when a call needs a bigger one, or runs on another mesh (`mesh`: where the weights are placed;
    None: one device)."""

    def __init__(self, config: ModelConfig, *, page_size: int = 0, slots: int = 0, steps_per_call: int = 16,
                 pages: int = 0, attention: str = "auto") -> None:
        self.config, self.page_size, self.slots, self.steps_per_call, self.pages = (
            config, page_size or default_page_size(), slots, steps_per_call, pages)
        self.attention = attention
        self.engine: Engine | ShardedEngine | None = None

    keeps_conversations = True  # `conversations(...)`: the engine, whose `generate(..., keep=True)` continues them

    def describe(self, mesh: Mesh) -> str:
        """The rollout engine on `mesh` with the attention, matmul and sampling paths its decode step runs here and
        why a kernel is not used (`kernels.describe_paths`)."""
        shards = shards_locally(mesh)  # one engine per data-parallel shard, on its tensor devices
        devices = mesh.shape["tensor"] if shards else mesh.size
        where = f"one engine per data-parallel shard ({mesh.size // devices}), " if shards else ""
        return f"the rollout engine, {where}{describe_paths(self.config, self.attention, devices)}"

    def conversations(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh | None = None
                      ) -> Engine | ShardedEngine:
        """The engine that continues conversations turn after turn (`generate(..., keep=True)`, `release`), with a
        pool for `sequences` (`engine_for`)."""
        return self.engine_for(sequences, n, mesh)

    def engine_for(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh | None = None
                   ) -> Engine | ShardedEngine:
        """An engine with a pool for `sequences` (`(prompt length, tokens after it)` each, `n` samples of each) on
        `mesh`: on a mesh of several data-parallel positions in this process, one engine per shard
        (`sharded.ShardedEngine`, the pool and the slots split between them)."""
        size = self.page_size
        each = [-(-p // size) + n * -(-(p + t) // size) for p, t in sequences]
        need = self.pages or 1 + sum(each)
        slots = self.slots or n * len(sequences)
        sharded = shards_locally(mesh)
        if (self.engine is None or self.engine.num_pages < need or self.engine.slots < slots
                or self.engine.mesh != mesh or isinstance(self.engine, ShardedEngine) != sharded):
            self.engine = None  # the old pool goes before the new one is made
            kwargs = dict(page_size=size, steps_per_call=self.steps_per_call, attention=self.attention)
            self.engine = (ShardedEngine(self.config, num_pages=need, slots=slots, mesh=mesh,  # type: ignore[arg-type]
                                         min_shard_pages=1 + max(each, default=0), **kwargs) if sharded
                           else Engine(self.config, num_pages=need, slots=slots, mesh=mesh, **kwargs))
        return self.engine

    def __call__(self, params: Params, tokens: Any, mask: Any, key: jax.Array,
                 sampling: SamplingConfig, mesh: Mesh | None = None) -> SampleOutput:
        """`sample`'s result through the engine (a call it cannot serve, `engine_context_problem`, is a
        `ConfigError` naming `sampling.engine=static`; `LongContextHandover` routes such calls)."""
        mesh = mesh if mesh is not None else mesh_of(params, None)
        engine = self.engine_for([(int(m.sum()), sampling.max_new_tokens) for m in np.asarray(mask)], sampling.n,
                                 mesh)
        return engine_sample(engine, params, self.config, tokens, mask, key, sampling)


class LongContextHandover:
    """A longrope model's sampler (`make_sampler`): each call that may pass the model's original context
    (`engine_context_problem`: the batch-wide switch to the long factors, which a per-row engine cannot reproduce)
    goes to the static sampler, said once in a line on stderr; every other call, and the conversations of
    multi-turn rollouts (where a turn past it is a `ConfigError`), to the rollout engine."""

    keeps_conversations = True

    def __init__(self, paged: PagedSampler, static: StaticSampler) -> None:
        self.paged, self.static, self.config = paged, static, paged.config
        self.handed_over = False  # a call went to the static sampler (said once)

    @property
    def engine(self) -> Engine | ShardedEngine | None:
        return self.paged.engine

    def describe(self, mesh: Mesh) -> str:
        return (f"{self.paged.describe(mesh)}; calls that may pass this longrope model's original context of "
                f"{longrope_original(self.config)} tokens: the static sampler")

    def conversations(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh | None = None
                      ) -> Engine | ShardedEngine:
        return self.paged.conversations(sequences, n, mesh)

    def __call__(self, params: Params, tokens: Any, mask: Any, key: jax.Array,
                 sampling: SamplingConfig, mesh: Mesh | None = None) -> SampleOutput:
        why = engine_context_problem(self.config, int(np.asarray(mask).sum(axis=1).max(initial=0))
                                     + sampling.max_new_tokens)
        if why is None:
            return self.paged(params, tokens, mask, key, sampling, mesh)
        if not self.handed_over:
            print(f"jaxrl_llm: {why}: the static sampler samples such calls", file=sys.stderr, flush=True)
            self.handed_over = True
        return self.static(params, tokens, mask, key, sampling, mesh)
