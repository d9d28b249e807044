"""The run's samplers (`sampling.engine`): one for each thread that samples, so the held-out evaluation (the shell's
thread) never shares a rollout engine with the rollouts in flight (the sampling thread beside training)."""

from __future__ import annotations

import threading

from jax.sharding import Mesh

from jaxrl_llm.config import SamplingSection
from jaxrl_llm.engine import Engine, make_sampler
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

    def describe(self, mesh: Mesh) -> str:
        """This thread's sampler on `mesh` in words (`Sampler.describe`), with the setting that chose it."""
        return f"{self.get().describe(mesh)} (sampling.engine={self.settings.engine})"
