"""What the RL algorithms that sample their batches share (the GRPO family, PPO): `RolloutAlgorithm`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState
from jaxrl_llm.envs.sandbox import describe_sandbox, use_sandbox
from jaxrl_llm.trainers.base import Algorithm, Collected, State
from jaxrl_llm.trainers.policy import GreedyEvaluation, load_policy
from jaxrl_llm.trainers.rollouts import DriftMeter, Rollout, RolloutCollector, rollout_tokens
from jaxrl_llm.trainers.step import frozen_copy, make_logprob_fn
from jaxrl_llm.trainers.trajectories import EpisodeEvaluation, TrajectoryCollector


def update_sizes(c: RunConfig) -> tuple[int, int, int]:
    """`(rollout size, minibatch size, optimizer updates per step)`."""
    r = c.rl
    rollout = r.prompts_per_step * r.group_size
    minibatch = r.minibatch_size or rollout
    return rollout, minibatch, r.mu * (rollout // minibatch)


def rl_micro_batch(c: RunConfig) -> tuple[str, int]:
    """The micro-batch of the GRPO family's and PPO's data-parallel step."""
    rollout, minibatch, _ = update_sizes(c)
    return f"the micro-batch rl.minibatch_size / rl.grad_accum = {minibatch // c.rl.grad_accum} sequences", \
        minibatch // c.rl.grad_accum


CODE_TESTS = ("code_tests", "jaxrl_llm.rewards.code_execution:code_tests_reward")


def sandbox_users(c: RunConfig) -> list[str]:
    """What in the run executes model code in the sandbox (`env.sandbox`): the python tool, the code_tests reward."""
    users = ["the python tool (env.tools)"] if c.env.name and "python" in c.env.tools else []
    rewards = [spec.name for spec in c.rewards] + [c.eval_reward]
    return users + [f"the {name} reward" for name in dict.fromkeys(rewards) if name in CODE_TESTS]


class RolloutAlgorithm(Algorithm):
    """What the algorithms that sample their batches share (the GRPO family, PPO): the policy, the rollout
    collector, the held-out evaluation and the drift meter, and the shell's calls that only read them. `reference`:
    keep the starting policy as the reference (a frozen copy; under LoRA the base itself)."""

    @classmethod
    def micro_batch(cls, c: RunConfig) -> tuple[str, int]:
        return rl_micro_batch(c)

    def __init__(self, config: RunConfig, *, reference: bool) -> None:
        super().__init__(config)
        c = config
        use_sandbox(c.env.sandbox)  # where the python tool and the code_tests reward run model code
        self.policy = p = load_policy(c)
        self.mesh, self.vocab_size = p.mesh, p.model_config.vocab_size
        # Multi-turn episodes with an environment (env.name), else one completion per prompt.
        self.collector = TrajectoryCollector(p) if c.env.name else RolloutCollector(p)
        self.evaluation = (EpisodeEvaluation(self.collector, c.eval_batch_size) if c.env.name
                           else GreedyEvaluation(p, c.eval_batch_size))
        self.ref_params = (p.base if p.base is not None else frozen_copy(p.initial_params, p.model_config)) \
            if reference else None
        self.ref_logprob_fn = make_logprob_fn(p.mesh, p.model_config, c.sampling.temperature, p.weights_sharding,
                                              block_mib=c.model.logprob_block_mib)
        self.drift_meter = DriftMeter(p, self.ref_params, self.ref_logprob_fn, c.monitor.drift_rows)

    def describe(self) -> str:
        p = self.policy
        users = sandbox_users(self.config)
        sandbox = f"; {' and '.join(users)}: {describe_sandbox()}" if users else ""
        return (f"model {p.tokenizer_dir} ({p.model_config.num_params() / 1e6:.2f}M params), "
                f"{self.collector.describe()}, {jax.device_count()} device(s){sandbox}")

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        ro, data_state, refills = self.collector.collect(self.policy.inference_weights(state["params"]), data_state,
                                                         key)
        return Collected(ro, data_state, self.collector.metrics(ro, refills), rollout_tokens(ro))

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        return self.evaluation(self.policy.inference_weights(state["params"]), limit)

    def drift(self, state: State, ro: Rollout) -> dict[str, float]:
        return self.drift_meter(state["params"], ro)

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        # `kl` only with a reference: approx_kl, the on-policy ratio's, is ~0 and would read as a bug.
        kl = {"kl": metrics["kl"]} if "kl" in metrics else {}
        return {"reward": metrics["reward/mean"], **kl, "s/step": metrics["time/step"]}

    def sample_rows(self, ro: Rollout) -> list[dict[str, Any]]:
        return self.collector.sample_rows(ro)

    def export(self, state: State, directory: Path) -> str:
        return self.policy.export(state["params"], directory)
