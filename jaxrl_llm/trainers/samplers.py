"""The run's samplers (`sampling.engine`): one for each thread that samples, so the held-out evaluation (the shell's
thread) never shares a rollout engine with the rollouts in flight (the sampling thread beside training)."""

from __future__ import annotations

import threading

from jax.sharding import Mesh

from jaxrl_llm.config import SamplingSection
from jaxrl_llm.engine import Engine, PagedSampler, make_sampler
from jaxrl_llm.engine.kernels import describe_paths
from jaxrl_llm.engine.sharded import shards_locally
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import Sampler


class ThreadSamplers:
    """Each thread's sampler of `model` with the `sampling` section's engine and `engine_*` settings
    (`engine.make_sampler`), made on the thread's first call."""

    def __init__(self, settings: SamplingSection, model: ModelConfig) -> None:
        self.settings, self.model = settings, model
        self.by_thread: dict[int, Sampler] = {}

    def get(self) -> Sampler:
        """This thread's sampler."""
        thread = threading.get_ident()
        if thread not in self.by_thread:
            s = self.settings
            self.by_thread[thread] = make_sampler(s.engine, self.model, page_size=s.engine_page_size,
                                                  slots=s.engine_slots, steps_per_call=s.engine_steps_per_call,
                                                  pages=s.engine_pages, attention=s.engine_attention)
        return self.by_thread[thread]

    @property
    def engine(self) -> Engine | None:
        """The rollout engine sampled through last (`sampling.engine=paged`), else None."""
        made = [getattr(s, "engine", None) for s in self.by_thread.values()]
        made = [e for e in made if e is not None]
        return made[-1] if made else None

    def rollout_engine(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh) -> Engine:
        """This thread's rollout engine with a pool for `sequences` (`(prompt length, tokens after it)` each, `n`
        samples of each; `sampling.engine_pages` when set) on `mesh`, made anew only when the current pool is smaller
        or elsewhere."""
        sampler = self.get()
        assert isinstance(sampler, PagedSampler), "a sampler that keeps conversations: the rollout engine's"
        return sampler.engine_for(sequences, n, mesh)

    def describe(self, mesh: Mesh) -> str:
        """The sampler on `mesh` in words: the static one, or the rollout engine with the attention, matmul and
        sampling paths its decode step runs here and why a kernel is not used (`kernels.describe_paths`)."""
        if not self.get().keeps_conversations:
            return f"the static sampler (sampling.engine={self.settings.engine})"
        shards = shards_locally(mesh)  # one engine per data-parallel shard, on its tensor devices
        devices = mesh.shape["tensor"] if shards else mesh.size
        where = f"one engine per data-parallel shard ({mesh.size // devices}), " if shards else ""
        return f"the rollout engine, {where}{describe_paths(self.model, self.settings.engine_attention, devices)}"
