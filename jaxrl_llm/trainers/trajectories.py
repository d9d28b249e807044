"""Multi-turn rollouts: each row is an episode with an environment, built on the jitted sampler.

    opening = env.reset()                         rendered like a single-turn prompt (chat template, system prompt,
                                                  the tools' declarations)
    turn 1: sample G completions of each prompt   exactly the single-turn sampler call (same key, same shapes)
    repeat until every episode is done (the environment says so, max_turns, the token budget, a cut turn):
        env.step(text of the turn)                on the host, in worker threads, each cut at env.timeout_s
        append the environment's messages         rendered by the chat template, masked out of the loss
        sample the next turn of the live rows     the conversation so far re-prefilled (no KV carried over)

The update sees exactly the sampled token ids: a turn's tokens are appended as the sampler returned them and
never re-tokenized from text, and only the environment's messages are tokenized. `loss_mask [N, T]` is 1 on the
model's tokens and 0 on the environment's; `mask` (attention) is 1 on both. The old policy's log-probs are the
sampler's for the model's tokens. The run's reward functions score the last assistant message; the environment's
per-turn rewards are added to it (one reward per trajectory), or are the whole reward when the run has none.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm.config import DataSection
from jaxrl_llm.data import PromptSet, bucket, encode_text, left_pad, render_prompt
from jaxrl_llm.envs.base import Environment, Message, StepResult, resolve_environment
from jaxrl_llm.envs.deadlines import Call, DeadlineExceeded, DeadlineWorkers, HungCalls
from jaxrl_llm.envs.tools import Tool, resolve_tools, template_supports_tools, tool_instructions
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling import SampleOutput, SamplingConfig, sample
from jaxrl_llm.sharding import to_host
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.rollouts import Rollout, RolloutCollector

TEXT_TOOL_RESULT = "\n<tool_response>\n{content}\n</tool_response>\n"  # a tool's answer without a chat template


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

    @property
    def final_text(self) -> str:
        return next((m["content"] for m in reversed(self.conversation) if m["role"] == "assistant"), "")

    def add_model_turn(self, ids: list[int], logprobs: list[float], untruncated: list[float], stopped_on_eos: bool,
                       text: str) -> None:
        """The sampled ids of a turn, as they are (in the loss), with the sampler's log-probs and its text."""
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


def followup_text(tokenizer: Any, messages: list[Message], *, chat: bool) -> str:
    """The text that follows a model's turn (which ended with its EOS token) when `messages` come next: what the
    chat template renders after the assistant's end-of-turn, through the next assistant header; without a chat
    template, each message's content (a tool's wrapped in <tool_response>)."""
    if not chat:
        return "".join(TEXT_TOOL_RESULT.format(content=m["content"]) if m["role"] == "tool" else m["content"]
                       for m in messages)
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token or ""
    end = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    return before[end:] + after[len(before):]  # e.g. "\n" + "<|im_start|>tool\n...<|im_end|>\n<|im_start|>assistant\n"


class TrajectoryCollector(RolloutCollector):
    """Samples and scores multi-turn episodes (`env:` section) from `data.train`; a `Rollout` with a loss mask."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        c = policy.config
        e = c.env
        self.env_config, self.factory = e, resolve_environment(e.name)
        self.tools = resolve_tools(e.tools)
        self.env_kwargs = {**dict(e.kwargs), **({"tools": self.tools} if self.tools else {})}
        self.tool_schemas, self.data_config = declare_tools(self.tools, c.data, policy.tokenizer)
        self.workers = DeadlineWorkers(e.workers, "jaxrl_llm-env")
        self.env_seconds = 0.0

    def describe(self) -> str:
        tools = f" with tools {', '.join(t.name for t in self.tools)}" if self.tools else ""
        return f"{super().describe()}, environment {self.env_config.name}{tools}, {self.env_config.max_turns} turns"

    def _open(self, record: dict[str, Any]) -> tuple[Environment | None, list[Message] | str, str]:
        return open_episode(self.factory, self.env_kwargs, record, self.policy.config.data)

    def rollout(self, params: Params, indices: np.ndarray, key: jax.Array) -> Rollout:
        """G episodes of each prompt, scored: the rollout the update reads, with `loss_mask`."""
        g, self.env_seconds = self.group_size, 0.0
        episodes, texts, tokens, mask = self.run_episodes(params, self.prompts, indices, key,
                                                          self.policy.sampling_config(n=g))
        records = [self.prompts.records[i] for i in indices for _ in range(g)]
        return self._assemble(episodes, records, [texts[r // g] for r in range(len(episodes))],
                              np.repeat(tokens, g, axis=0), np.repeat(mask, g, axis=0), indices)

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
        episodes = [Episode(env, rendered[r // g][1], conversation=_as_messages(opening), error=error,
                            done=env is None) for r, (env, opening, error) in enumerate(opened)]
        width = bucket(max(len(ids) for _, ids in rendered), c.sampling.prompt_bucket)
        tokens, mask = left_pad([ids for _, ids in rendered], width, p.pad_id)
        self._take_turn(episodes, list(range(len(episodes))),
                        to_host(sample(params, p.model_config, tokens, mask, key, sampling, mesh=p.mesh)))
        for turn in range(2, self.env_config.max_turns + 1):
            live = [r for r, ep in enumerate(episodes) if not ep.done]
            if not live:
                break
            self._sample_turn(params, episodes, live, jax.random.fold_in(key, turn),
                              dataclasses.replace(sampling, n=1))
        for ep in episodes:
            ep.done = True
        return episodes, [text for text, _ in rendered], tokens, mask

    def _sample_turn(self, params: Params, episodes: list[Episode], live: list[int], key: jax.Array,
                     sampling: SamplingConfig) -> None:
        """The next turn of the `live` rows: each conversation so far re-prefilled, one sample each."""
        p, c = self.policy, self.policy.config
        budget = min(c.env.max_tokens - len(episodes[r].tokens) for r in live)
        contexts = [episodes[r].prompt_ids + episodes[r].tokens for r in live]
        tokens, mask = left_pad(contexts, bucket(max(map(len, contexts)), c.sampling.prompt_bucket), p.pad_id)
        sampling = dataclasses.replace(sampling, max_new_tokens=max(1, min(c.sampling.max_new_tokens, budget)))
        self._take_turn(episodes, live, to_host(sample(params, p.model_config, tokens, mask, key, sampling,
                                                       mesh=p.mesh)))

    def _take_turn(self, episodes: list[Episode], rows: list[int], out: SampleOutput) -> None:
        """Append the sampled turn of each of `rows` (`out` row i is `rows[i]`), then step their environments."""
        tokenizer, e = self.policy.tokenizer, self.env_config
        texts = []
        for i, r in enumerate(rows):
            m = np.asarray(out.mask[i], bool)
            ids = np.asarray(out.tokens[i])[m].tolist()
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            episodes[r].add_model_turn(ids, np.asarray(out.logprobs[i])[m].tolist(),
                                       np.asarray(out.logprobs_untruncated[i])[m].tolist(),
                                       bool(out.stopped_on_eos[i]), texts[-1])
        t0 = time.monotonic()
        deadline = t0 + e.timeout_s  # every step of the turn is submitted now: none runs or is waited for past this
        steps = {r: self.workers.submit(episodes[r].env.step, text, deadline=deadline)
                 for r, text in zip(rows, texts, strict=True) if episodes[r].env is not None and not episodes[r].done}
        for r in rows:
            ep = episodes[r]
            result = step_result(self.workers, steps[r], ep, e.timeout_s) if r in steps else StepResult([], done=True)
            ep.record_step(result, e.max_turns)
            if not ep.done:  # the environment's messages, rendered; past the token budget the episode ends instead
                text = followup_text(tokenizer, result.messages, chat=self.data_config.chat_template)
                ids = encode_text(tokenizer, text, add_special_tokens=False)
                ep.done = not result.messages or len(ep.tokens) + len(ids) >= e.max_tokens
                if not ep.done:
                    ep.add_env_messages(ids, result.messages)
        self.env_seconds += time.monotonic() - t0

    def _assemble(self, episodes: list[Episode], records: list[dict[str, Any]], prompt_texts: list[str],
                  prompt_tokens: np.ndarray, prompt_mask: np.ndarray, indices: np.ndarray) -> Rollout:
        """The episodes as right-padded `[N, T]` arrays (T: sampling.max_new_tokens when every episode fits it, so
        a one-turn rollout has a single-turn rollout's shapes; else the longest rounded up to its bucket), scored."""
        s = self.policy.config.sampling
        out, loss_mask = episode_arrays(episodes, self.policy.pad_id, s.max_new_tokens, s.new_tokens_bucket)
        completions = [ep.final_text for ep in episodes]
        rewards, each = self._rewards(records, prompt_texts, completions, out)
        env_rewards = np.asarray([ep.env_reward for ep in episodes], np.float32)
        if env_rewards.any() or not each:  # with no reward function the environment's rewards are the reward
            rewards, each = rewards + env_rewards, {**each, "env": env_rewards}
        credit = turn_credit(episodes, loss_mask.shape[1])
        return Rollout(prompt_tokens, prompt_mask, out, rewards, each, completions, indices, loss_mask=loss_mask,
                       conversations=[ep.conversation for ep in episodes], episode_stats=episode_stats(episodes),
                       env_seconds=self.env_seconds, turn_credit=credit if credit.any() else None)

    def metrics(self, ro: Rollout, refills: int) -> dict[str, float]:
        """The single-turn metrics over the model's tokens, and the episodes': turns, tool calls, tool errors,
        environment time and the share of the completion tokens that are the environment's."""
        return {**super().metrics(ro, refills), **episode_rollout_metrics(ro)}

    def sample_rows(self, ro: Rollout, limit: int = 16) -> list[dict[str, Any]]:
        """Whole conversations: each message with its role (the model's turns are `assistant`)."""
        return [{**row, "conversation": ro.conversations[j], "turns": int(ro.episode_stats["turns"][j]),
                 "tool_calls": int(ro.episode_stats["tool_calls"][j])}
                for j, row in enumerate(super().sample_rows(ro, limit))]


def declare_tools(tools: list[Tool], data: DataSection, tokenizer: Any
                  ) -> tuple[list[dict[str, Any]] | None, DataSection]:
    """How the tools reach the model: their JSON schemas for a chat template that renders them (else None), and the
    data settings whose system prompt carries the plain-text convention (`tool_instructions`) otherwise."""
    native = bool(tools) and data.chat_template and template_supports_tools(tokenizer)
    extra = tool_instructions(tools) if tools and not native else ""
    joiner = "\n\n" if data.chat_template else "\n"
    system = joiner.join(s for s in (extra, data.system_prompt) if s)
    return ([t.schema for t in tools] if native else None), dataclasses.replace(data, system_prompt=system)


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


def episode_arrays(episodes: list[Episode], pad_id: int, max_new_tokens: int, multiple: int
                   ) -> tuple[SampleOutput, np.ndarray]:
    """The episodes as right-padded `[N, T]` arrays and their loss mask: T is `max_new_tokens` when every episode
    fits it (so a one-turn rollout has a single-turn rollout's shapes), else the longest rounded up to `multiple`;
    `lengths` count the model's tokens."""
    longest = max(len(ep.tokens) for ep in episodes)
    width, n = max_new_tokens if longest <= max_new_tokens else bucket(longest, multiple), len(episodes)
    tokens, mask, loss_mask = (np.full((n, width), pad_id, np.int32), np.zeros((n, width), np.int32),
                               np.zeros((n, width), np.int32))
    logprobs, untruncated = np.zeros((n, width), np.float32), np.zeros((n, width), np.float32)
    for r, ep in enumerate(episodes):
        k = len(ep.tokens)
        tokens[r, :k], mask[r, :k], loss_mask[r, :k] = ep.tokens, 1, ep.loss_mask
        logprobs[r, :k], untruncated[r, :k] = ep.logprobs, ep.logprobs_untruncated
    return SampleOutput(tokens, mask, logprobs, untruncated, loss_mask.sum(axis=1).astype(np.int32),
                        np.asarray([ep.stopped_on_eos for ep in episodes])), loss_mask


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


def _as_messages(opening: list[Message] | str) -> list[Message]:
    return [{"role": "user", "content": opening}] if isinstance(opening, str) else list(opening)
