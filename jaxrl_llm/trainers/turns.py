"""How the turns of a batch of episodes are sampled (`trainers/trajectories.py` plays the episodes).

- `engine_turns`: through the rollout engine (`sampling.engine=paged`): a group's prompt prefilled once, and each
  conversation kept in the engine's pages between turns, so a turn prefills only the environment's reply;
- `prefilled_turns`: through a sampler without conversations: the first turn is the single-turn sampler call, and
  each later one prefills every live conversation so far again.

Both hand every sampled turn to `take_turn` (which appends it to its episodes, `add_sampled_turns`, and steps their
environments) and stop when every episode is done or after `env.max_turns`; a turn is cut at the token budget
left (`env.max_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm.data import bucket
from jaxrl_llm.engine import Request, row_keys, sample_output
from jaxrl_llm.envs.rendering import turn_text
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling import SampleOutput, SamplingConfig
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import mesh_of, to_host
from jaxrl_llm.trainers.episodes import Episode
from jaxrl_llm.trainers.policy import Policy

# `take_turn(episodes, rows, out)`: row i of `out` is the sampled turn of episode `rows[i]`.
TakeTurn = Callable[[list[Episode], list[int], SampleOutput], None]


def live_rows(episodes: list[Episode]) -> list[int]:
    """The rows whose episode goes on."""
    return [r for r, ep in enumerate(episodes) if not ep.done]


def engine_turns(policy: Policy, params: Params, episodes: list[Episode], prompts: list[list[int]], key: jax.Array,
                 sampling: SamplingConfig, take_turn: TakeTurn) -> None:
    """Every turn of `sampling.n` episodes of each prompt through the rollout engine; each row's turn is cut at its
    own remaining token budget, and every conversation's pages are released at the end."""
    p, e, g = policy, policy.config.env, sampling.n
    engine = p.samplers.get().conversations([(len(ids), e.max_tokens) for ids in prompts], g, mesh_of(params, p.mesh))
    keys = row_keys(key, len(prompts))
    requests = [Request(ids, keys[i], n=g) for i, ids in enumerate(prompts)]
    done = [c for group in engine.generate(params, requests, sampling, keep=True) for c in group]
    kept = {r: c.conversation for r, c in enumerate(done)}
    try:
        lengths = [len(ids) for ids in prompts for _ in range(g)]
        take_turn(episodes, list(range(len(episodes))),
                  sample_output(done, sampling.max_new_tokens, p.pad_id, lengths, max(lengths)))
        for turn in range(2, e.max_turns + 1):
            for r, ep in enumerate(episodes):
                if ep.done and kept.get(r) is not None:
                    engine.release(kept.pop(r))
            live = live_rows(episodes)
            if not live:
                break
            budgets = [max(1, min(sampling.max_new_tokens, e.max_tokens - len(episodes[r].tokens))) for r in live]
            turn_keys = row_keys(jax.random.fold_in(key, turn), len(episodes))
            requests = [Request((episodes[r].prompt_ids + episodes[r].tokens)[len(kept[r].tokens):],
                                turn_keys[r], max_new_tokens=b, conversation=kept[r])
                        for r, b in zip(live, budgets, strict=True)]
            step = dataclasses.replace(sampling, n=1, max_new_tokens=max(budgets))
            done = [group[0] for group in engine.generate(params, requests, step, keep=True)]
            kept.update({r: c.conversation for r, c in zip(live, done, strict=True)})
            contexts = [len(episodes[r].prompt_ids) + len(episodes[r].tokens) for r in live]
            take_turn(episodes, live, sample_output(done, step.max_new_tokens, p.pad_id, contexts, max(contexts)))
    finally:
        for conversation in kept.values():
            if conversation is not None and conversation.pages:
                engine.release(conversation)


def prefilled_turns(policy: Policy, params: Params, episodes: list[Episode], tokens: np.ndarray, mask: np.ndarray,
                    key: jax.Array, sampling: SamplingConfig, take_turn: TakeTurn) -> None:
    """Every turn of `sampling.n` episodes of each left-padded prompt (`tokens`, `mask` `[P, W]`): the first as the
    single-turn sampler samples (same key, same shapes), each later one from the live rows' whole contexts, one
    sample each, cut at the smallest budget left among them."""
    p, c = policy, policy.config
    take_turn(episodes, list(range(len(episodes))), to_host(p.sample(params, tokens, mask, key, sampling)))
    for turn in range(2, c.env.max_turns + 1):
        live = live_rows(episodes)
        if not live:
            break
        budget = min(c.env.max_tokens - len(episodes[r].tokens) for r in live)
        contexts = [episodes[r].prompt_ids + episodes[r].tokens for r in live]
        tokens, mask = left_pad(contexts, bucket(max(map(len, contexts)), c.sampling.prompt_bucket), p.pad_id)
        step = dataclasses.replace(sampling, n=1, max_new_tokens=max(1, min(c.sampling.max_new_tokens, budget)))
        take_turn(episodes, live, to_host(p.sample(params, tokens, mask, jax.random.fold_in(key, turn), step)))


def add_sampled_turns(episodes: list[Episode], rows: list[int], out: SampleOutput, tokenizer: Any,
                      markers: Sequence[str]) -> list[str]:
    """Append the sampled turn of each of `rows` (`out` row i is `rows[i]`) to its episode: the ids as sampled, their
    log-probs, whether it stopped on EOS and (MoE) the experts of its context and ids; returns each turn's text
    (`turn_text`, keeping the tool format's `markers`)."""
    texts = []
    width = None if out.routing is None else out.routing.shape[1] - out.tokens.shape[1]  # the context's columns
    for i, r in enumerate(rows):
        m = np.asarray(out.mask[i], bool)
        ids = np.asarray(out.tokens[i])[m].tolist()
        texts.append(turn_text(tokenizer, ids, markers))
        experts = None
        if width is not None:  # the context right-aligned in the first `width` columns, then the fed ids
            context = len(episodes[r].prompt_ids) + len(episodes[r].tokens)
            experts = np.asarray(out.routing[i, width - context:width + len(ids)], np.int16)
        episodes[r].add_model_turn(ids, np.asarray(out.logprobs[i])[m].tolist(),
                                   np.asarray(out.logprobs_untruncated[i])[m].tolist(),
                                   bool(out.stopped_on_eos[i]), texts[-1], experts)
    return texts
