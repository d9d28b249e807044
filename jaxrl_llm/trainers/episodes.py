"""One multi-turn episode's record (`Episode`: the model's and the environment's tokens, the sampler's log-probs,
the conversation, the counters), the environment's calls that drive it under deadlines (`open_episode`,
`opened_episode`, `step_result`), and the finished episodes as the update's arrays: right-padded tokens with a
loss mask (`episode_arrays`), per-turn credit (`turn_credit`) and statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_llm.config import DataSection
from jaxrl_llm.data import bucket
from jaxrl_llm.envs.base import Environment, Message, StepResult
from jaxrl_llm.envs.deadlines import Call, DeadlineExceeded, DeadlineWorkers, HungCalls
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.moe import NO_RECORD
from jaxrl_llm.sampling import SampleOutput
from jaxrl_llm.sampling.padding import right_pad
from jaxrl_llm.trainers.rollouts import Rollout


@dataclasses.dataclass
class Episode:
    """One row's episode while it is rolled out: its environment, its tokens after the prompt (the model's and
    the environment's, told apart by `loss_mask`), the sampler's log-probs, the conversation, and its counters."""

    env: Environment | None
    prompt_ids: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    logprobs_untruncated: list[float] = dataclasses.field(default_factory=list)
    conversation: list[Message] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float = 0.0
    turn_rewards: list[float] = dataclasses.field(default_factory=list)  # the environment's, after each turn
    token_turns: list[int] = dataclasses.field(default_factory=list)  # each token's turn (1, 2, ...; 0: env)
    done: bool = False
    stopped_on_eos: bool = True
    error: str = ""
    # An MoE model's routing record of the context so far (`prompt_ids + tokens`, `[<= len, L, k]` int16): the latest
    # turn's, whose sampler routed the whole context (the environment's tokens too) and its own fed tokens.
    experts: np.ndarray | None = None

    @property
    def final_text(self) -> str:
        return next((m["content"] for m in reversed(self.conversation) if m["role"] == "assistant"), "")

    def add_model_turn(self, ids: list[int], logprobs: list[float], untruncated: list[float], stopped_on_eos: bool,
                       text: str, experts: np.ndarray | None = None) -> None:
        """The sampled ids of a turn, as they are (in the loss), with the sampler's log-probs and its text; `experts`:
        an MoE sampler's record of the context this turn saw and of the ids it fed (`[<= context + len(ids), L, k]`)."""
        if experts is not None:
            self.experts = experts
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.token_turns += [self.turns + 1] * len(ids)
        self.logprobs += logprobs
        self.logprobs_untruncated += untruncated
        self.turns += 1
        self.stopped_on_eos = stopped_on_eos
        self.conversation.append({"role": "assistant", "content": text})

    def record_step(self, result: StepResult, max_turns: int) -> None:
        """The environment's answer to the last turn: its reward and counters, and whether the episode is over (it
        says so, the turn was cut at its token limit, or this was the last turn)."""
        self.env_reward += float(result.reward)
        self.turn_rewards.append(float(result.reward))
        self.tool_calls += int(result.info.get("tool_calls", 0))
        self.tool_errors += int(result.info.get("tool_errors", 0))
        self.done = self.done or result.done or not self.stopped_on_eos or self.turns >= max_turns

    def add_env_messages(self, ids: list[int], messages: list[Message]) -> None:
        """The environment's messages and their rendered ids (out of the loss; log-probs 0)."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.token_turns += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.logprobs_untruncated += [0.0] * len(ids)
        self.conversation += messages


def open_episode(factory: Any, kwargs: dict[str, Any], record: dict[str, Any], data: DataSection
                 ) -> tuple[Environment | None, list[Message] | str, str]:
    """A new environment for `record`, its opening (messages, or the text of a text-mode prompt) and an error: an
    environment that cannot start leaves an empty episode (it scores 0), a `ConfigError` stops the run."""
    try:
        env = factory(record, **kwargs)
        opening = env.reset()
    except ConfigError:  # the run's settings are wrong (a missing package, an unknown game): stop it
        raise
    except Exception as e:  # an environment that cannot start: the episode is empty and scores 0
        return None, record.get(data.prompt_field, ""), f"reset failed: {e}"
    if not data.chat_template and len(opening) == 1 and opening[0]["role"] == "user":
        return env, opening[0]["content"], ""  # a text-mode prompt renders as text, as a single-turn one
    return env, opening, ""


def opened_episode(workers: DeadlineWorkers, call: Call, record: dict[str, Any], data: DataSection,
                   timeout_s: float) -> tuple[Environment | None, list[Message] | str, str]:
    """`open_episode`'s answer, or an empty episode when the environment's factory or `reset` did not return by
    its deadline (a `ConfigError` still stops the run)."""
    try:
        return workers.result(call)
    except HungCalls as e:
        error = f"the environment did not start: {e}"
    except DeadlineExceeded:
        error = f"the environment's reset took longer than env.timeout_s={timeout_s:g} s"
    return None, record.get(data.prompt_field, ""), error


def step_result(workers: DeadlineWorkers, call: Call, ep: Episode, timeout_s: float) -> StepResult:
    """The environment's answer, or (it raised, or was not done by its deadline) the end of the episode."""
    try:
        result = workers.result(call)
        return result if isinstance(result, StepResult) else StepResult(*result)
    except HungCalls as e:
        ep.error = f"the environment did not step: {e}"
    except DeadlineExceeded:
        ep.error = f"the environment took longer than env.timeout_s={timeout_s:g} s"
    except Exception as e:  # the environment's bug ends its own episode, never the run
        ep.error = f"the environment raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return StepResult([], done=True, info={"error": ep.error})


def episode_arrays(episodes: list[Episode], pad_id: int, max_new_tokens: int, multiple: int, prompt_width: int = 0
                   ) -> tuple[SampleOutput, np.ndarray]:
    """The episodes as right-padded `[N, T]` arrays and their loss mask: T is `max_new_tokens` when every episode
    fits it (so a one-turn rollout has a single-turn rollout's shapes), else the longest rounded up to `multiple`;
    `lengths` count the model's tokens. An MoE model's episodes (with `experts`) also give `routing [N, prompt_width +
    T, L, k]`: each prompt's records right-aligned in the first `prompt_width` columns (its left-padded place), then
    the tokens' (the model's and the environment's), `moe.NO_RECORD` where nothing was routed."""
    longest = max(len(ep.tokens) for ep in episodes)
    width, n = max_new_tokens if longest <= max_new_tokens else bucket(longest, multiple), len(episodes)
    tokens, mask = right_pad([ep.tokens for ep in episodes], width, pad_id)
    loss_mask = right_pad([ep.loss_mask for ep in episodes], width)[0]
    logprobs, untruncated = (right_pad([getattr(ep, name) for ep in episodes], width, dtype=np.float32)[0]
                             for name in ("logprobs", "logprobs_untruncated"))
    routing = None
    recorded = [ep.experts for ep in episodes if ep.experts is not None]
    if recorded:
        routing = np.full((n, prompt_width + width, *recorded[0].shape[1:]), NO_RECORD, np.int16)
        for r, ep in enumerate(episodes):
            if ep.experts is not None:
                start = prompt_width - len(ep.prompt_ids)
                record = ep.experts[:len(ep.prompt_ids) + width]
                routing[r, start:start + len(record)] = record
    return SampleOutput(tokens, mask, logprobs, untruncated, loss_mask.sum(axis=1).astype(np.int32),
                        np.asarray([ep.stopped_on_eos for ep in episodes]), routing), loss_mask


def turn_credit(episodes: list[Episode], width: int) -> np.ndarray:
    """`[N, width]` float32: on each model token of turn k, minus the environment's rewards of the turns before k
    (`G_k - G_1` of `rl.advantages.turn_level_advantages`); 0 on the first turn's and the environment's tokens."""
    credit = np.zeros((len(episodes), width), np.float32)
    for r, ep in enumerate(episodes):
        earned = np.concatenate([[0.0], np.cumsum(ep.turn_rewards)])  # before turn k: earned[k - 1]
        turns = np.asarray(ep.token_turns, np.int64)
        credit[r, : len(turns)] = np.where(turns > 0, -earned[np.clip(turns - 1, 0, len(earned) - 1)], 0.0)
    return credit


def episode_stats(episodes: list[Episode]) -> dict[str, np.ndarray]:
    """Each episode's turns, tool calls, failed calls and environment error `[N]`."""
    return {"turns": np.asarray([ep.turns for ep in episodes]),
            "tool_calls": np.asarray([ep.tool_calls for ep in episodes]),
            "tool_errors": np.asarray([ep.tool_errors for ep in episodes]),
            "env_errors": np.asarray([bool(ep.error) for ep in episodes]),
            "env_error_messages": np.asarray([ep.error for ep in episodes])}


def episode_rollout_metrics(ro: Rollout) -> dict[str, float]:
    """Turns and tool calls per episode, the share of episodes with a call, failed calls per call, episodes ended
    by an environment fault, seconds in environment steps, and the share of completion tokens that are the
    environment's."""
    s, calls = ro.episode_stats, float(ro.episode_stats["tool_calls"].sum())
    mask, loss_mask = np.asarray(ro.out.mask), np.asarray(ro.loss_mask)
    return {"turns/mean": float(s["turns"].mean()), "tool_calls/mean": float(s["tool_calls"].mean()),
            "tool_calls/frac_episodes": float((s["tool_calls"] > 0).mean()),
            "tool_errors/frac": float(s["tool_errors"].sum() / calls) if calls else 0.0,
            "env_errors/frac": float(s["env_errors"].mean()), "time/env": ro.env_seconds,
            "masked_tokens/frac": float(1.0 - loss_mask.sum() / max(mask.sum(), 1))}


def as_messages(opening: list[Message] | str) -> list[Message]:
    return [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)
