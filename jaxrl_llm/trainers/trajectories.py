"""Multi-turn rollouts: each row is an episode with an environment, built on the jitted sampler.

    opening = env.reset()                         rendered like a single-turn prompt (chat template, system prompt,
                                                  the tools' declarations)
    turn 1: sample G completions of each prompt   exactly the single-turn sampler call (same key, same shapes)
    repeat until every episode is done (the environment says so, max_turns, the token budget, a cut turn):
        env.step(text of the turn)                on the host, in worker threads, each cut at env.timeout_s
        append the environment's messages         rendered by the chat template, masked out of the loss
        sample the next turn of the live rows     the conversation so far re-prefilled, or (the rollout engine)
                                                  continued from its pages (trainers/turns.py)

The update sees exactly the sampled token ids: a turn's tokens are appended as the sampler returned them and
never re-tokenized from text, and only the environment's messages are tokenized. `loss_mask [N, T]` is 1 on the
model's tokens and 0 on the environment's; `mask` (attention) is 1 on both. The old policy's log-probs are the
sampler's for the model's tokens. The run's reward functions score the last assistant message; the environment's
per-turn rewards are added to it (one reward per trajectory), or are the whole reward when the run has none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_llm.data import PromptSet, bucket, encode_text, render_prompt
from jaxrl_llm.envs.base import Environment, Message, StepResult, resolve_environment
from jaxrl_llm.envs.deadlines import DeadlineWorkers
from jaxrl_llm.envs.rendering import declare_tools, exceeds_budget, followup_text, resolve_tool_format
from jaxrl_llm.envs.tool_formats import with_response_parsing
from jaxrl_llm.envs.tool_use import ToolUseEnvironment
from jaxrl_llm.envs.tools import resolve_tools
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling import SampleOutput, SamplingConfig
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import mesh_of
from jaxrl_llm.trainers.episodes import (
    Episode,
    as_messages,
    episode_arrays,
    episode_rollout_metrics,
    episode_stats,
    open_episode,
    opened_episode,
    step_result,
    turn_credit,
)
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.rollouts import Rollout, RolloutCollector
from jaxrl_llm.trainers.turns import add_sampled_turns, engine_turns, prefilled_turns


class TrajectoryCollector(RolloutCollector):
    """Samples and scores multi-turn episodes (`env:` section) from `data.train`; a `Rollout` with a loss mask."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        c = policy.config
        e = c.env
        self.env_config, self.factory = e, resolve_environment(e.name)
        self.tools = resolve_tools(e.tools)
        named, self.tool_format_why = resolve_tool_format(e.tool_format, policy.tokenizer, chat=c.data.chat_template)
        # the calls read by transformers' parse_response where the tokenizer has a response template, else by ours
        self.tool_format, self.tool_parser_why = with_response_parsing(named, policy.tokenizer,
                                                                       chat=c.data.chat_template)
        self.markers = self.tool_format.markers if self.tools else ()  # special tokens a turn's text keeps
        # the built-in tool_use environment parses with the format itself; any other is given its name
        given = self.tool_format if self.factory is ToolUseEnvironment else self.tool_format.name
        self.env_kwargs = {**dict(e.kwargs), **({"tools": self.tools, "tool_format": given} if self.tools else {})}
        self.tool_schemas, self.data_config = declare_tools(self.tools, c.data, policy.tokenizer, self.tool_format)
        self.workers = DeadlineWorkers(e.workers, "jaxrl_llm-env")
        self.env_seconds = 0.0

    def describe(self) -> str:
        tools = (f" with tools {', '.join(t.name for t in self.tools)} ({self.tool_format.name} calls, "
                 f"{self.tool_format_why}; parsed by {self.tool_parser_why})" if self.tools else "")
        return f"{super().describe()}, environment {self.env_config.name}{tools}, {self.env_config.max_turns} turns"

    def _open(self, record: dict[str, Any]) -> tuple[Environment | None, list[Message] | str, str]:
        return open_episode(self.factory, self.env_kwargs, record, self.policy.config.data)

    def sampled(self, params: Params, indices: np.ndarray, key: jax.Array) -> Callable[[], Rollout]:
        """G episodes of each prompt played to their end (the model's turns and the environment's steps: sampling
        needs the replies); the returned call scores them into the rollout the update reads, with `loss_mask`.
        `rollout` and `collect_in_stages` (sampling beside training) both come here, as for single-turn rows."""
        g, self.env_seconds = self.group_size, 0.0
        episodes, texts, tokens, mask = self.run_episodes(params, self.prompts, indices, key,
                                                          self.policy.sampling_config(n=g))
        records = [self.prompts.records[i] for i in indices for _ in range(g)]
        env_seconds = self.env_seconds  # the next rollout may start (a sampler thread) before this one is scored
        return lambda: self._assemble(episodes, records, [texts[r // g] for r in range(len(episodes))],
                                      np.repeat(tokens, g, axis=0), np.repeat(mask, g, axis=0), indices, env_seconds)

    def run_episodes(self, params: Params, prompts: PromptSet, indices: np.ndarray, key: jax.Array,
                     sampling: SamplingConfig) -> tuple[list[Episode], list[str], np.ndarray, np.ndarray]:
        """`sampling.n` episodes of each prompt of `indices` (rows prompt-major), played to their end; with the
        rendered prompts' texts and their left-padded tokens and mask `[P, W]`."""
        p, g, c = self.policy, sampling.n, self.policy.config
        t0 = time.monotonic()
        records = [prompts.records[i] for i in indices for _ in range(g)]
        calls = [self.workers.submit(self._open, record, deadline=t0 + self.env_config.timeout_s)
                 for record in records]
        opened = [opened_episode(self.workers, call, record, self.policy.config.data, self.env_config.timeout_s)
                  for call, record in zip(calls, records, strict=True)]
        self.env_seconds += time.monotonic() - t0
        rendered = [render_prompt(opened[i * g][1], self.data_config, p.tokenizer, f"prompt {j}", self.tool_schemas)
                    for i, j in enumerate(indices)]
        episodes = [Episode(env, rendered[r // g][1], conversation=as_messages(opening), error=error,
                            done=env is None) for r, (env, opening, error) in enumerate(opened)]
        width = bucket(max(len(ids) for _, ids in rendered), c.sampling.prompt_bucket)
        tokens, mask = left_pad([ids for _, ids in rendered], width, p.pad_id)
        if p.samplers.get().keeps_conversations:
            with jax.default_device(mesh_of(params, p.mesh).devices.flat[0]):  # where the weights are
                engine_turns(p, params, episodes, [ids for _, ids in rendered], key, sampling, self._take_turn)
        else:  # a sampler without conversations: whole contexts
            prefilled_turns(p, params, episodes, tokens, mask, key, sampling, self._take_turn)
        for ep in episodes:
            ep.done = True
        return episodes, [text for text, _ in rendered], tokens, mask

    def _take_turn(self, episodes: list[Episode], rows: list[int], out: SampleOutput) -> None:
        """Append the sampled turn of each of `rows` (`out` row i is `rows[i]`), then step their environments: each
        reply rendered and appended, or the episode ended (done, max_turns, past its token budget)."""
        tokenizer, e = self.policy.tokenizer, self.env_config
        texts = add_sampled_turns(episodes, rows, out, tokenizer, self.markers)
        t0 = time.monotonic()
        deadline = t0 + e.timeout_s  # every step of the turn is submitted now: none runs or is waited for past this
        steps = {r: self.workers.submit(episodes[r].env.step, text, deadline=deadline)
                 for r, text in zip(rows, texts, strict=True) if episodes[r].env is not None and not episodes[r].done}
        for r in rows:
            ep = episodes[r]
            result = step_result(self.workers, steps[r], ep, e.timeout_s) if r in steps else StepResult([], done=True)
            ep.record_step(result, e.max_turns)
            if not ep.done and exceeds_budget(tokenizer, result.messages, e.max_tokens - len(ep.tokens)):
                ep.done = True  # a reply longer than the budget, known from its length: never rendered nor tokenized
            if not ep.done:  # the environment's messages, rendered; past the token budget the episode ends instead
                text = followup_text(tokenizer, result.messages, chat=self.data_config.chat_template)
                ids = encode_text(tokenizer, text, add_special_tokens=False)
                ep.done = not result.messages or len(ep.tokens) + len(ids) >= e.max_tokens
                if not ep.done:
                    ep.add_env_messages(ids, result.messages)
        self.env_seconds += time.monotonic() - t0

    def _assemble(self, episodes: list[Episode], records: list[dict[str, Any]], prompt_texts: list[str],
                  prompt_tokens: np.ndarray, prompt_mask: np.ndarray, indices: np.ndarray,
                  env_seconds: float) -> Rollout:
        """The episodes as right-padded `[N, T]` arrays (T: sampling.max_new_tokens when every episode fits it, so
        a one-turn rollout has a single-turn rollout's shapes; else the longest rounded up to its bucket), scored."""
        s = self.policy.config.sampling
        out, loss_mask = episode_arrays(episodes, self.policy.pad_id, s.max_new_tokens, s.new_tokens_bucket,
                                        prompt_tokens.shape[1])
        completions = [ep.final_text for ep in episodes]
        rewards, each = self._rewards(records, prompt_texts, completions, out)
        env_rewards = np.asarray([ep.env_reward for ep in episodes], np.float32)
        if env_rewards.any() or not each:  # with no reward function the environment's rewards are the reward
            rewards, each = rewards + env_rewards, {**each, "env": env_rewards}
        credit = turn_credit(episodes, loss_mask.shape[1])
        return Rollout(prompt_tokens, prompt_mask, out, rewards, each, completions, indices, loss_mask=loss_mask,
                       conversations=[ep.conversation for ep in episodes], episode_stats=episode_stats(episodes),
                       env_seconds=env_seconds, turn_credit=credit if credit.any() else None)

    def metrics(self, ro: Rollout, refills: int) -> dict[str, float]:
        """The single-turn metrics over the model's tokens, and the episodes': turns, tool calls, tool errors,
        environment time and the share of the completion tokens that are the environment's."""
        return {**super().metrics(ro, refills), **episode_rollout_metrics(ro)}

    def sample_rows(self, ro: Rollout, limit: int = 16) -> list[dict[str, Any]]:
        """Whole conversations: each message with its role (the model's turns are `assistant`)."""
        return [{**row, "conversation": ro.conversations[j], "turns": int(ro.episode_stats["turns"][j]),
                 "tool_calls": int(ro.episode_stats["tool_calls"][j])}
                for j, row in enumerate(super().sample_rows(ro, limit))]


