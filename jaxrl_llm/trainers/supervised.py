"""What the algorithms that read examples or pairs share (SFT, the reward model, DPO): `ExampleAlgorithm`, one
optimizer update of `sft.batch_size` examples a step. The RL algorithms' shared code is `trainers/rl.py`."""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import numpy as np
import optax

from jaxrl_llm.config import RunConfig
from jaxrl_llm.models.packing import batch_layout, packing_pays
from jaxrl_llm.sharding import batch_divisor, global_array
from jaxrl_llm.trainers.base import Algorithm, State, Updated, host_metrics


def packed_example_batch(batch: Any, valid: np.ndarray, prompt_width: int, *, packing: bool,
                         mesh: Any, num_params: int = 0, min_gflops: float = 0.0) -> tuple[Any, dict[str, float]]:
    """`(batch, metrics)` of an example batch (`sft.packing`): with packing, `batch` with the packed `layout` of
    its sequences (`packing.batch_layout` of their input mask `valid [N, S]`, rows a multiple of the data-parallel
    devices) when that takes fewer rows and the batch's padded forward is at least `min_gflops` GFLOP for a model of
    `num_params` (`packing.packing_pays`); the share of the positions the update computes that are padding."""
    padded = batch, {"update/padding_frac": 1.0 - float(valid.mean())}
    if not packing or not packing_pays(valid.size, num_params, min_gflops):
        return padded
    layout, _, padding = batch_layout(valid, prompt_width, multiple=batch_divisor(mesh))
    if layout.source.shape[0] >= valid.shape[0]:
        return padded  # nothing shares a row
    return batch._replace(layout=layout), {"update/padding_frac": padding}


def example_update(update_fn: Any, mesh: Any, schedule: optax.Schedule, state: State, batch: Any, step: int,
                   key: jax.Array, frozen: Any = None) -> Updated:
    """One optimizer update of an algorithm that reads examples (SFT, reward model, DPO): the host batch onto the
    mesh, the jitted `update_fn(state, batch, key, frozen)`, its metrics with the step's learning rate."""
    batch = jax.tree.map(lambda x: global_array(x, mesh), batch)
    state, metrics = update_fn(state, batch, key, frozen)
    out, skipped = host_metrics(metrics)
    out["learning_rate"] = float(schedule(step - 1))
    return Updated(state, out, skipped)


class ExampleAlgorithm(Algorithm):
    """The base of the algorithms that read examples or pairs (SFT, reward model, DPO): one optimizer update of
    `sft.batch_size` examples a step through `self.update_fn` (a `jit_update`), with `self.schedule`'s rate and
    `self.frozen_input` (LoRA's base, a reference model, or None) as the frozen input."""

    collect_phase: ClassVar[str] = "data"
    needs_rewards: ClassVar[bool] = False
    update_fn: Any
    schedule: optax.Schedule
    frozen_input: Any = None

    @classmethod
    def micro_batch(cls, config: RunConfig) -> tuple[str, int]:
        return f"sft.batch_size={config.sft.batch_size}", config.sft.batch_size

    def update(self, state: State, batch: Any, step: int, key: jax.Array) -> Updated:
        return example_update(self.update_fn, self.mesh, self.schedule, state, batch, step, key, self.frozen_input)
