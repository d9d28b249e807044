"""Held-out evaluation of a policy, single-turn and in an environment: `GreedyEvaluation` (greedy accuracy on
`data.eval`, scored by `jaxrl_llm.evaluation`) and `EpisodeEvaluation` (each prompt played once, greedy, to the
episode's end, `episode_metrics`). The algorithms call one as `evaluate(state, limit)`; `python -m jaxrl_llm
eval` uses the same ones."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import PromptSet
from jaxrl_llm.evaluation import evaluate_greedy
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.rewards import RewardFunction, resolve_reward
from jaxrl_llm.trainers.episodes import Episode
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.trajectories import TrajectoryCollector


def eval_reward(c: RunConfig) -> tuple[str, RewardFunction]:
    """The held-out accuracy's reward: `eval_reward` if set, else the first of `rewards`."""
    if c.eval_reward:
        return c.eval_reward, resolve_reward(c.eval_reward)
    return c.rewards[0].name, resolve_reward(c.rewards[0].name, dict(c.rewards[0].kwargs))


class GreedyEvaluation:
    """Held-out greedy accuracy of the policy on `source` (default `data.eval`; nothing when it is empty)."""

    def __init__(self, policy: Policy, batch_size: int, source: str | None = None) -> None:
        c = policy.config
        source = c.data.eval if source is None else source
        self.policy, self.batch_size = policy, batch_size
        self.prompts = policy.prompt_set(source, c.data.eval_split, c.data.train) if source else None
        self.reward = eval_reward(c) if source else None

    def __call__(self, params: Params, limit: int | None) -> dict[str, float]:
        if self.prompts is None:
            return {}
        p = self.policy
        return evaluate_greedy(params, p.sampler_config, p.tokenizer, self.prompts, self.reward,
                               p.sampling_config(greedy=True), batch_size=self.batch_size, limit=limit,
                               sampler=p.sample)


class EpisodeEvaluation:
    """Held-out greedy success of the policy in its environment: each prompt of `data.eval` played once, greedy,
    to the episode's end, scored like training: an episode's return is the environment's rewards plus the eval
    reward's score of the final answer (`eval_reward`, else the first of `rewards`; none when the run has neither,
    and the environment's rewards are the whole return). `episode_metrics` says what is logged."""

    def __init__(self, collector: TrajectoryCollector, batch_size: int) -> None:
        p, c = collector.policy, collector.policy.config
        self.collector, self.batch_size = collector, batch_size
        self.prompts = p.prompt_set(c.data.eval, c.data.eval_split, c.data.train) if c.data.eval else None
        self.reward = eval_reward(c) if c.data.eval and (c.eval_reward or c.rewards) else None

    def __call__(self, params: Params, limit: int | None) -> dict[str, float]:
        if self.prompts is None:
            return {}
        episodes, scores, _ = self.play(params, self.prompts, limit)
        return episode_metrics(episodes, scores, self.reward[0] if self.reward else None)

    def play(self, params: Params, prompts: PromptSet, limit: int | None
             ) -> tuple[list[Episode], np.ndarray, list[str]]:
        """Each of the first `limit` prompts played once, greedy: the episodes, the eval reward's score of each
        final answer (0 without an eval reward), and each episode's rendered opening (with the tools'
        declarations)."""
        count = len(prompts) if limit is None else min(limit, len(prompts))
        greedy = self.collector.policy.sampling_config(greedy=True, n=1)
        episodes: list[Episode] = []
        texts: list[str] = []
        for start in range(0, count, self.batch_size):
            indices = np.arange(start, min(start + self.batch_size, count))
            played, rendered, _, _ = self.collector.run_episodes(params, prompts, indices, jax.random.key(0), greedy)
            episodes, texts = episodes + played, texts + rendered
        if self.reward is None:
            return episodes, np.zeros(len(episodes)), texts
        records = prompts.records[:count]
        fields = {k: [r.get(k) for r in records] for k in set().union(*records)}
        scores = self.reward[1](texts, [ep.final_text for ep in episodes], **fields)
        return episodes, np.asarray(scores, np.float64), texts


def episode_metrics(episodes: list[Episode], scores: np.ndarray, reward_name: str | None) -> dict[str, float]:
    """Held-out metrics of greedy episodes: `eval/return` (the mean of each episode's environment rewards plus its
    eval reward score), `eval/accuracy` (the share of episodes whose return reaches 1), `eval/env` (the
    environment's rewards), `eval/<reward>` (the eval reward's mean, when there is one), turns and tool calls per
    episode, and the share of calls that failed."""
    calls = sum(ep.tool_calls for ep in episodes)
    env = np.asarray([ep.env_reward for ep in episodes], np.float64)
    returns = env + scores
    return {"eval/accuracy": float((returns >= 1.0).mean()), "eval/return": float(returns.mean()),
            "eval/env": float(env.mean()), **({f"eval/{reward_name}": float(scores.mean())} if reward_name else {}),
            "eval/turns": float(np.mean([ep.turns for ep in episodes])),
            "eval/tool_calls": float(np.mean([ep.tool_calls for ep in episodes])),
            "eval/tool_errors": float(sum(ep.tool_errors for ep in episodes) / calls) if calls else 0.0}
