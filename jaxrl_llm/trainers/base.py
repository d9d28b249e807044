"""The algorithm contract: what the loop shell (`trainers/loop.py`) asks of every algorithm, with real defaults.

An algorithm is built once from the config (`__init__`: models, tokenizer, optimizers, jitted functions, all
static) and then works on a state pytree that the shell owns, passes in and checkpoints:

    init()                                  -> state                        the starting weights, optimizer state, ...
    collect(state, data_state, key)         -> Collected(batch, data_state, metrics, tokens)
      = collect_with(sampler_weights(state), data_state, key) where the algorithm samples beside training
    update(state, batch, step, key)         -> Updated(state, metrics, skipped)
    evaluate(state, limit) / drift(state, batch) / export(state, directory)

It never touches files and never keeps the state itself. A batch may be a rollout of single replies or of
multi-turn trajectories: the shell only passes it from `collect` to `update`, `drift` and `sample_rows`.
`validate(config)` checks the algorithm's own settings before anything loads (`jaxrl_llm.preflight`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState

State = dict[str, Any]


class Collected(NamedTuple):
    """What `collect` returns: the batch, the data position after it, its metrics, and the completion tokens
    it sampled (None for algorithms that read examples; the shell turns it into tokens_per_second)."""

    batch: Any
    data_state: DataState
    metrics: dict[str, float]
    tokens: float | None = None


class Updated(NamedTuple):
    """What `update` returns: the new state, the step's metrics, and whether its last optimizer update was
    skipped for a non-finite gradient (the monitor stops a run after several in a row)."""

    state: State
    metrics: dict[str, float]
    skipped: bool = False


def host_metrics(metrics: Any) -> tuple[dict[str, float], bool]:
    """A jitted update's metrics as host floats, and whether its last optimizer update was skipped
    (`last_update_skipped` of scanned updates, else `update_skipped` of a single one; not kept as a metric)."""
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
    skipped = out.pop("last_update_skipped", out.get("update_skipped", 0.0))
    return out, bool(skipped)


class Algorithm:
    """The base of the algorithms (`trainers/__init__.ALGORITHMS`); subclasses override what they do."""

    label: ClassVar[str] = "train"  # the progress bar's name
    collect_phase: ClassVar[str] = "rollout"  # "data" for algorithms that read examples: names time/<phase>
    evaluates_before: ClassVar[bool] = True  # evaluate the starting model before step 1
    from_scratch: ClassVar[bool] = False  # True: model.init trains a new model, model.path is not read
    needs_rewards: ClassVar[bool] = True  # the run needs `rewards` (RL); False: trained on examples or pairs
    group_relative: ClassVar[bool] = True  # advantages compare a group's samples: all alike = no signal
    # Why this algorithm cannot sample beside training (rollout.max_staleness, rollout.sampler_devices); "" = it can
    # (then `sampler_weights` and `collect_with` are its collect's two halves)
    no_overlap: ClassVar[str] = "it samples no rollouts (it trains on examples or pairs)"
    mesh: Any
    vocab_size: int

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    @classmethod
    def validate(cls, config: RunConfig) -> None:
        """One-line `ConfigError` for settings this algorithm cannot run with (no devices or files needed)."""

    @classmethod
    def model_sources(cls, config: RunConfig) -> dict[str, str]:
        """The models besides `model.path` the run reads, by their config key (a critic's, a teacher's): each
        must be a directory or a reachable hub id before the run starts."""
        return {}

    @classmethod
    def held_out_prompts(cls, config: RunConfig) -> str:
        """The config key of the held-out prompts whose answers a reward scores (`eval_reward`, else `rewards`,
        else an environment's), "" when there are none."""
        return "data.eval" if config.data.eval else ""

    @classmethod
    def keeps_reference(cls, config: RunConfig) -> bool:
        """Whether the run keeps a frozen reference policy beside the trained one (what the planner counts)."""
        return config.rl.beta > 0

    @classmethod
    def teacher(cls, config: RunConfig) -> tuple[str, bool]:
        """`(the teacher model the run reads, whether it runs inside the update)`; `("", False)`: no teacher."""
        return "", False

    @classmethod
    def micro_batch(cls, config: RunConfig) -> tuple[str, int] | None:
        """`(what, rows)` of the batch one data-parallel step splits over the devices, or None."""
        return None

    def init(self) -> State:
        raise NotImplementedError

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        raise NotImplementedError

    def sampler_weights(self, state: State) -> Any:
        """The weights `collect` samples with, placed where the sampler runs (its own mesh, or a copy on the
        trainer's that the update's donated buffers cannot take away): what the shell pushes after each update."""
        raise NotImplementedError

    def collect_with(self, weights: Any, data_state: DataState, key: jax.Array) -> Collected:
        """`collect` with the weights `sampler_weights` gave (maybe an older policy's): what the sampler thread
        runs when rollouts are sampled beside training."""
        raise NotImplementedError

    def sample_with(self, weights: Any, data_state: DataState, key: jax.Array
                    ) -> tuple[DataState, Callable[[], Collected]]:
        """`collect_with` in two stages: the sampling (here) and what follows it on the host (decoding, reward
        functions: the returned call), so the sampler thread samples the next rollout while this one is scored.
        Returns the data position after the rollout and the call that finishes it. By default all of
        `collect_with` runs here (rollouts whose sampling needs their rewards: dynamic sampling, episodes)."""
        collected = self.collect_with(weights, data_state, key)
        return collected.data_state, lambda: collected

    def update(self, state: State, batch: Any, step: int, key: jax.Array) -> Updated:
        raise NotImplementedError

    def export(self, state: State, directory: Path) -> str:
        raise NotImplementedError

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        return {}

    def drift(self, state: State, batch: Any) -> dict[str, float]:
        """`{"drift_kl": KL(pi || pi_initial) per token}` at evaluation steps; {} when not measured."""
        return {}

    def describe(self) -> str:
        return self.label

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        return {}

    def sample_rows(self, batch: Any) -> list[dict[str, Any]]:
        return []

    def no_learning_signal(self, metrics: dict[str, float]) -> bool:
        """The update had nothing to learn from: a zero gradient, or (group-relative advantages) no group whose
        completions scored differently."""
        zero_grad = metrics.get("grad_norm", 1.0) == 0.0 and not metrics.get("update_skipped", 0.0)
        return zero_grad or (self.group_relative and metrics.get("frac_zero_std_groups", 0.0) == 1.0)
