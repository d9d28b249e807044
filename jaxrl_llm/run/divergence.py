"""Collapse detection on an RL run's per-step metrics: pure functions over host floats.

A condition is named when it holds for `patience` steps in a row *and did not hold at the run's first
step* (its baseline): a run that starts in that regime (a random model's near-uniform output, all
completions truncated at first) has not diverged, while a policy that gets there during training has.
The conditions a converged policy can also meet (low entropy, one reward for all, every completion at the
length limit) count only while the mean reward is no better than at the first step: a policy that solved
its task is not collapsed, one that degenerated without gain is.

    entropy_collapsed   entropy < entropy_floor                          (one answer, deterministic)
    entropy_uniform     entropy > entropy_ceiling * log V                (noise over the whole vocabulary)
    kl_exploded         KL(pi || pi_ref) per token > kl_max
    reward_stuck        every completion scored the same, equal to the previous step's score
    completions_empty   every completion is empty (at most the EOS token)
    completions_truncated  every completion hit max_new_tokens

Non-finite gradients are handled separately (skipped updates, `trainer.MAX_CONSECUTIVE_SKIPPED_UPDATES`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# Conditions a good, converged policy may meet too: they count only when the reward has not improved.
NEED_NO_GAIN = ("entropy_collapsed", "reward_stuck", "completions_empty", "completions_truncated")


@dataclasses.dataclass(frozen=True)
class DivergenceLimits:
    patience: int = 5
    entropy_floor: float = 0.01
    entropy_ceiling: float = 0.95
    kl_max: float = 10.0
    reward_stuck: bool = True


@dataclasses.dataclass(frozen=True)
class DivergenceState:
    """Consecutive steps each condition has held, the baseline (first step) conditions and the last reward."""

    streaks: dict[str, int] = dataclasses.field(default_factory=dict)
    baseline: tuple[str, ...] | None = None
    last_reward: float | None = None
    baseline_reward: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"streaks": dict(self.streaks), "baseline": None if self.baseline is None else list(self.baseline),
                "last_reward": self.last_reward, "baseline_reward": self.baseline_reward}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> DivergenceState:
        if not data:
            return cls()
        baseline = data.get("baseline")
        return cls(dict(data.get("streaks", {})), None if baseline is None else tuple(baseline),
                   data.get("last_reward"), data.get("baseline_reward"))


def conditions_holding(metrics: dict[str, float], *, vocab_size: int, limits: DivergenceLimits,
                       last_reward: float | None) -> dict[str, str]:
    """The conditions this step's metrics meet, each with a description naming its numbers."""
    out: dict[str, str] = {}
    entropy = metrics.get("entropy")
    if entropy is not None and math.isfinite(entropy):
        if entropy < limits.entropy_floor:
            out["entropy_collapsed"] = f"entropy {entropy:.4g} < {limits.entropy_floor:g} nats/token"
        ceiling = limits.entropy_ceiling * math.log(vocab_size)
        if entropy > ceiling:
            out["entropy_uniform"] = (f"entropy {entropy:.4g} > {limits.entropy_ceiling:g} * log V = {ceiling:.4g} "
                                      f"nats/token (near-uniform output)")
    kl = metrics.get("kl")
    if kl is not None and (not math.isfinite(kl) or kl > limits.kl_max):
        out["kl_exploded"] = f"KL to the reference {kl:.4g} > {limits.kl_max:g} nats/token"
    reward, std = metrics.get("reward/mean"), metrics.get("reward/std")
    if limits.reward_stuck and reward is not None and std == 0.0 and last_reward == reward:
        out["reward_stuck"] = f"every completion scored {reward:.4g}, as in the previous step"
    if metrics.get("completion_length/max", 2.0) <= 1.0:
        out["completions_empty"] = "every completion is empty"
    if metrics.get("frac_truncated", 0.0) >= 1.0:
        out["completions_truncated"] = "every completion was cut at sampling.max_new_tokens"
    return out


def update_divergence(state: DivergenceState, metrics: dict[str, float], *, vocab_size: int,
                      limits: DivergenceLimits) -> tuple[DivergenceState, dict[str, str]]:
    """The new state after one step, and the conditions that now count as a divergence (held `patience` steps
    in a row, and not at the baseline step) with their descriptions. `patience == 0` turns the checks off."""
    if limits.patience == 0:
        return state, {}
    holding = conditions_holding(metrics, vocab_size=vocab_size, limits=limits, last_reward=state.last_reward)
    reward = metrics.get("reward/mean")
    if state.baseline is None:  # at the first step "stuck" means: no reward variance to start with
        first = conditions_holding(metrics, vocab_size=vocab_size, limits=limits, last_reward=reward)
        baseline, baseline_reward = tuple(sorted(first)), reward
    else:
        baseline, baseline_reward = state.baseline, state.baseline_reward
    no_gain = reward is None or baseline_reward is None or reward <= baseline_reward
    counted = [n for n in holding if n not in baseline and (no_gain or n not in NEED_NO_GAIN)]
    streaks = {name: state.streaks.get(name, 0) + 1 for name in counted}
    diverged = {name: f"{holding[name]} for {n} steps" for name, n in streaks.items() if n >= limits.patience}
    new = DivergenceState(streaks, baseline, None if reward is None else float(reward),
                          None if baseline_reward is None else float(baseline_reward))
    return new, diverged
