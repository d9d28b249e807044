"""Rollouts of the RL algorithms: P prompts x G samples, scored by the reward functions.

    prompts (data order) -> sample (jit, on the mesh) -> decode -> rewards (host; each process scores its
    own groups, then all-gather) -> Rollout

With dynamic sampling (DAPO), groups whose rewards are all equal carry no learning signal and are replaced by
freshly sampled ones, up to `max_refill_rounds` extra rounds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm.config import RewardSpec
from jaxrl_llm.data import DataState, PromptSet, bucket, next_batch_indices
from jaxrl_llm.evaluation import decode_completions, reward_fields
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.moe import NO_RECORD
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.rewards import RewardFunction, compute_rewards, resolve_reward
from jaxrl_llm.run.monitor import drift_kl, repeated_ngram_fraction
from jaxrl_llm.sampling import SampleOutput
from jaxrl_llm.sampling.padding import right_pad
from jaxrl_llm.sharding import batch_divisor, global_array, process_rows, to_host
from jaxrl_llm.trainers.policy import Policy


@dataclasses.dataclass
class Rollout:
    prompt_tokens: np.ndarray  # [N, P], N = prompts * group_size, group-major
    prompt_mask: np.ndarray
    out: SampleOutput
    rewards: np.ndarray  # [N]
    per_function: dict[str, np.ndarray]
    completions: list[str]
    record_indices: np.ndarray  # [N // G] prompt records
    # Multi-turn episodes (trainers/trajectories.py): 1 on the model's tokens, 0 on the environment's; None when
    # every completion token is the model's (then `out.mask` is the loss mask too)
    loss_mask: np.ndarray | None = None
    conversations: list[list[dict[str, Any]]] | None = None  # [N] each episode's messages
    episode_stats: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # [N] turns, tool_calls, ...
    env_seconds: float = 0.0
    # [N, T] per-turn credit when the environment rewards turns (rl.advantages.turn_level_advantages), else None
    turn_credit: np.ndarray | None = None

    def sequences(self) -> Sequences:
        """The rollout's sequences on the host (`models.sequences.Sequences`): its prompts, the sampled
        completions with their mask, and the loss mask (a multi-turn rollout's, else the completion mask: so a
        single-turn and a multi-turn rollout run one update program, and round alike); what the update places on
        the mesh."""
        mask = np.asarray(self.out.mask)
        return Sequences(self.prompt_tokens, self.prompt_mask, np.asarray(self.out.tokens), mask,
                         mask if self.loss_mask is None else self.loss_mask)

    @functools.cached_property
    def input_valid(self) -> np.ndarray:
        """`[N, P + T - 1]` bool: the model's valid inputs (`Sequences.inputs`' mask), what the update's and the
        log-prob passes' packed layouts are planned from (made once per rollout)."""
        return self.sequences().inputs()[1] > 0


def assemble_groups(parts: list[tuple[Rollout, np.ndarray]], *, group_size: int, groups: int, pad_id: int) -> Rollout:
    """`groups` groups of `group_size` rows from the rollouts `parts` (each with its informative-group mask):
    informative ones first, then (if refills ran out) zero-variance ones (zero advantage), prompts re-padded to
    the widest."""
    g = group_size
    chosen = [(ro, i) for ro, keep in parts for i in np.flatnonzero(keep)]
    chosen += [(ro, i) for ro, keep in parts for i in np.flatnonzero(~keep)]
    chosen = chosen[:groups]
    width = max(ro.prompt_tokens.shape[1] for ro, _ in chosen)

    def take(get: Any) -> np.ndarray:
        return np.concatenate([get(ro)[i * g : (i + 1) * g] for ro, i in chosen])

    def pad_prompt(x: np.ndarray, value: int) -> np.ndarray:
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)

    def pad_routing(x: np.ndarray) -> np.ndarray:  # [N, P + T, L, k]: the prompt part re-padded on its left
        return np.pad(x, ((0, 0), (width - (x.shape[1] - ro_t), 0), (0, 0), (0, 0)), constant_values=NO_RECORD)

    ro_t = np.asarray(chosen[0][0].out.tokens).shape[1]
    fields = {f: take(lambda ro, f=f: np.asarray(getattr(ro.out, f))) for f in SampleOutput._fields if f != "routing"}
    routing = take(lambda ro: pad_routing(np.asarray(ro.out.routing))) if chosen[0][0].out.routing is not None \
        else None
    out = SampleOutput(**fields, routing=routing)
    return Rollout(
        prompt_tokens=take(lambda ro: pad_prompt(ro.prompt_tokens, pad_id)),
        prompt_mask=take(lambda ro: pad_prompt(ro.prompt_mask, 0)),
        out=out,
        rewards=take(lambda ro: ro.rewards),
        per_function={k: take(lambda ro, k=k: ro.per_function[k]) for k in parts[0][0].per_function},
        completions=[ro.completions[j] for ro, i in chosen for j in range(i * g, (i + 1) * g)],
        record_indices=np.asarray([ro.record_indices[i] for ro, i in chosen]),
        loss_mask=take(lambda ro: ro.loss_mask) if parts[0][0].loss_mask is not None else None,
        conversations=[ro.conversations[j] for ro, i in chosen for j in range(i * g, (i + 1) * g)]
        if parts[0][0].conversations is not None else None,
        episode_stats={k: take(lambda ro, k=k: ro.episode_stats[k]) for k in parts[0][0].episode_stats},
        env_seconds=sum(ro.env_seconds for ro, _ in parts),
        turn_credit=take(lambda ro: ro.turn_credit) if parts[0][0].turn_credit is not None else None,
    )


def tied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """``[P]`` bool: the groups whose ``group_size`` rewards are all equal (exactly: ``max == min``; a float32 std
    of equal values can be a rounding step above 0). Their advantage is 0 and they carry no gradient."""
    grouped = np.asarray(rewards).reshape(-1, group_size)
    return grouped.max(axis=1) == grouped.min(axis=1)


def rollout_tokens(ro: Rollout) -> float:
    """The completion tokens a rollout sampled (the shell's tokens_per_second)."""
    return float(np.asarray(ro.out.mask).sum())


def reward_functions(specs: Sequence[RewardSpec]) -> list[tuple[str, RewardFunction, float, float]]:
    """`(name, function, weight, timeout_s)` of each of the run's `rewards`; a name used twice gets its index
    (`math_answer`, `math_answer_1`), so each keeps its own metric."""
    out = []
    for i, spec in enumerate(specs):
        name = spec.name if all(s.name != spec.name for s in specs[:i]) else f"{spec.name}_{i}"
        out.append((name, resolve_reward(spec.name, dict(spec.kwargs)), spec.weight, spec.timeout_s))
    return out


def score_rows(reward_fns: list[tuple[str, RewardFunction, float, float]], records: list[dict[str, Any]],
               prompts: list[str], completions: list[str], out: SampleOutput, max_new_tokens: int,
               timings: dict[str, float]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`(rewards [N], each function's [N])` of every row, float32; with several processes each scores only its own
    share of the rows (whole groups), and the scores are then all-gathered. Each function's seconds add to
    `timings`."""
    mine = process_rows(len(prompts)) if jax.process_count() > 1 else slice(None)
    local = jax.tree.map(lambda x: np.asarray(x)[mine], out)
    rewards, each = compute_rewards(reward_fns, prompts[mine], completions[mine],
                                    reward_fields(records[mine], local, max_new_tokens), timings=timings)
    # float32 on every path: the cross-process all-gather carries float32, and the single-process run
    # must see the same numbers (e.g. dynamic sampling's std > 0 test).
    rewards, each = rewards.astype(np.float32), {k: v.astype(np.float32) for k, v in each.items()}
    if jax.process_count() == 1:
        return rewards, each
    gathered = multihost_utils.process_allgather((rewards, each), tiled=True)
    return np.asarray(gathered[0]), {k: np.asarray(v) for k, v in gathered[1].items()}


def answer_output(answers: list[list[int]], pad_id: int, eos_ids: tuple[int, ...], width_bucket: int
                  ) -> SampleOutput:
    """Token ids as the sampler's right-padded output (`[N, W]`, `W` rounded up to `width_bucket`): each row
    stopped on EOS when its last id is one, log-probs zero (no policy sampled them)."""
    tokens, mask = right_pad(answers, bucket(max(map(len, answers)), width_bucket), pad_id)
    stopped = np.asarray([ids[-1] in eos_ids for ids in answers])
    zeros = np.zeros(tokens.shape, np.float32)
    return SampleOutput(tokens, mask, zeros, zeros, mask.sum(axis=1).astype(np.int32), stopped)


def rollout_metrics(ro: Rollout, group_size: int) -> dict[str, float]:
    """Reward, length and truncation statistics of a rollout (before any update), the share of empty completions
    (no text), the repeated 3-gram fraction (`monitor.repeated_ngram_fraction`) and each reward function's mean."""
    lengths = np.asarray(ro.out.lengths)
    out = {
        "reward/mean": float(ro.rewards.mean()),
        "reward/std": float(np.std(ro.rewards - ro.rewards.flat[0])),  # shifted: one reward for all is 0.0
        "completion_length/mean": float(lengths.mean()),
        "completion_length/max": float(lengths.max()),
        "frac_truncated": float(1.0 - np.asarray(ro.out.stopped_on_eos).mean()),
        "frac_empty": float(np.mean([not c.strip() for c in ro.completions])),
        "repetition/ngram_frac": repeated_ngram_fraction(np.asarray(ro.out.tokens), np.asarray(ro.out.mask)),
    }
    if group_size > 1:  # every "group" of one has zero std: the number would mean nothing
        out["frac_zero_std_groups"] = float(tied_groups(ro.rewards, group_size).mean())
    return out | {f"reward/{name}/mean": float(values.mean()) for name, values in ro.per_function.items()}


class RolloutCollector:
    """Samples and scores rollouts from `data.train` with the run's reward functions."""

    def __init__(self, policy: Policy) -> None:
        c = policy.config
        self.policy = policy
        self.prompts: PromptSet = policy.prompt_set(c.data.train, c.data.split)
        self.group_size, self.prompts_per_step = c.rl.group_size, c.rl.prompts_per_step
        self.dynamic_sampling, self.max_refill_rounds = c.rl.dynamic_sampling, c.rl.max_refill_rounds
        self.reward_fns = reward_functions(c.rewards)
        self.reward_seconds: dict[str, float] = {}

    def _next_indices(self, state: DataState) -> tuple[np.ndarray, DataState]:
        c = self.policy.config
        return next_batch_indices(len(self.prompts), self.prompts_per_step, state, c.seed, c.data.shuffle)

    def collect(self, params: Params, state: DataState, key: jax.Array) -> tuple[Rollout, DataState, int]:
        """One rollout of P groups, the data position after it, and the refill rounds it took."""
        self.reward_seconds = {}
        indices, state = self._next_indices(state)
        ro = self.rollout(params, indices, key)
        if not self.dynamic_sampling:
            return ro, state, 0
        parts, rounds = [(ro, self.informative_groups(ro))], 0
        while sum(int(k.sum()) for _, k in parts) < self.prompts_per_step and rounds < self.max_refill_rounds:
            rounds += 1
            indices, state = self._next_indices(state)
            extra = self.rollout(params, indices, jax.random.fold_in(key, rounds))
            parts.append((extra, self.informative_groups(extra)))
        return assemble_groups(parts, group_size=self.group_size, groups=self.prompts_per_step,
                               pad_id=self.policy.pad_id), state, rounds

    def rollout(self, params: Params, indices: np.ndarray, key: jax.Array) -> Rollout:
        """Sample G completions for each prompt and score them."""
        return self.sampled(params, indices, key)()

    def sampled(self, params: Params, indices: np.ndarray, key: jax.Array) -> Callable[[], Rollout]:
        """Sample G completions for each prompt; the returned call scores them (`scored`)."""
        p, g = self.policy, self.group_size
        tokens, mask = p.prompt_arrays(self.prompts, indices)
        out = to_host(p.sample(params, tokens, mask, key, p.sampling_config(n=g)))
        return lambda: self.scored(indices, tokens, mask, out)

    @property
    def samples_in_stages(self) -> bool:
        """Whether `collect_in_stages` can sample a rollout before scoring it: not under dynamic sampling, whose
        refills depend on the rewards. Single-turn rows and multi-turn episodes (`sampled`) both can."""
        return not self.dynamic_sampling

    def collect_in_stages(self, params: Params, state: DataState, key: jax.Array
                          ) -> tuple[DataState, Callable[[], tuple[Rollout, dict[str, float]]]]:
        """`collect` in two stages (`samples_in_stages`): sample here; the returned call scores the rollout and
        gives it with its metrics (`metrics`), so a sampler thread can sample the next one meanwhile."""
        if not self.samples_in_stages:
            raise ValueError("RolloutCollector.collect_in_stages: dynamic sampling needs the rewards to sample")
        indices, state = self._next_indices(state)
        score = self.sampled(params, indices, key)

        def finish() -> tuple[Rollout, dict[str, float]]:
            self.reward_seconds = {}
            ro = score()
            return ro, self.metrics(ro, 0)

        return state, finish

    def scored(self, indices: np.ndarray, tokens: np.ndarray, mask: np.ndarray, out: SampleOutput) -> Rollout:
        """The rollout of prompts `indices` (left-padded `tokens`, `mask` `[P, width]`) and their completions
        `out` (G per prompt, group-major): decoded and scored."""
        g = self.group_size
        completions = decode_completions(self.policy.tokenizer, out)
        records = [self.prompts.records[i] for i in indices for _ in range(g)]
        texts = [self.prompts.texts[i] for i in indices for _ in range(g)]
        rewards, each = self._rewards(records, texts, completions, out)
        return Rollout(np.repeat(tokens, g, axis=0), np.repeat(mask, g, axis=0), out, rewards, each,
                       completions, indices)

    def answer_rollout(self, state: DataState) -> tuple[Rollout, DataState]:
        """The next P prompts with the data's answers as their completions (`data.answer_field` + EOS, each row
        of a group the same; cut at `sampling.max_new_tokens`), scored like samples; log-probs zero. What GKD
        trains on in its off-policy steps (`distill.lmbda`)."""
        p, g, c = self.policy, self.group_size, self.policy.config
        indices, state = self._next_indices(state)
        tokens, mask = p.prompt_arrays(self.prompts, indices)
        answers = [(p.tokenizer(str(self.prompts.records[i][c.data.answer_field]), add_special_tokens=False)
                    ["input_ids"] + [p.eos_ids[0]])[: c.sampling.max_new_tokens] for i in indices for _ in range(g)]
        out = answer_output(answers, p.pad_id, p.eos_ids, c.sampling.new_tokens_bucket)
        return self.scored(indices, tokens, mask, out), state

    def _rewards(self, records: list[dict[str, Any]], prompts: list[str], completions: list[str],
                 out: SampleOutput) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rewards of every row (`score_rows` with the run's reward functions), timed into `reward_seconds`."""
        return score_rows(self.reward_fns, records, prompts, completions, out,
                          self.policy.config.sampling.max_new_tokens, self.reward_seconds)

    def informative_groups(self, ro: Rollout) -> np.ndarray:
        return ~tied_groups(ro.rewards, self.group_size)

    def describe(self) -> str:
        return f"{len(self.prompts)} train prompts ({self.prompts.num_dropped} dropped as too long)"

    def metrics(self, ro: Rollout, refills: int) -> dict[str, float]:
        """`rollout_metrics`, with the reward functions' seconds and (dynamic sampling) the refill rounds."""
        out = rollout_metrics(ro, self.group_size) | {f"time/reward/{k}": v for k, v in self.reward_seconds.items()}
        return out | ({"dynamic_sampling/refill_rounds": float(refills)} if self.dynamic_sampling else {})

    def sample_rows(self, ro: Rollout, limit: int = 16) -> list[dict[str, Any]]:
        rows = []
        for j in range(min(limit, len(ro.completions))):
            record_index = int(ro.record_indices[j // self.group_size])
            rows.append({
                "prompt": self.prompts.texts[record_index],
                "completion": ro.completions[j],
                "reward": float(ro.rewards[j]),
                **{f"reward/{k}": float(v[j]) for k, v in ro.per_function.items()},
            })
        return rows


class DriftMeter:
    """`drift(params, rollout) -> {"drift_kl"}`: KL(pi || pi_initial) per token (`monitor.drift_kl`) of the
    trained `params` on the first
    `rows` rows of a rollout (rounded down to a multiple of the mesh's batch split), both log-probs recomputed
    at the sampling temperature. The initial policy is the reference when there is one (rl.beta > 0, or
    LoRA's base), else a copy of the starting weights kept on the host and put on the devices for each call."""

    def __init__(self, policy: Policy, reference: Params | None, logprob_fn: Any, rows: int) -> None:
        self.policy, self.reference, self.logprob_fn = policy, reference, logprob_fn
        self.rows = rows - rows % batch_divisor(policy.mesh)
        if reference is None and policy.base is not None:
            self.reference = policy.base
        self.initial_host = to_host(policy.initial_params) if self.reference is None and self.rows else None

    def __call__(self, params: Params, ro: Rollout) -> dict[str, float]:
        rows = min(self.rows, len(ro.rewards))
        rows -= rows % batch_divisor(self.policy.mesh)
        if rows <= 0:
            return {}
        p = self.policy
        initial = self.reference if self.reference is not None else jax.device_put(self.initial_host,
                                                                                   p.weights_sharding)
        sequences = jax.tree.map(lambda x: global_array(np.asarray(x)[:rows], p.mesh),
                                 ro.sequences()._replace(loss_mask=None))
        logp = to_host(self.logprob_fn(p.model_weights(params), sequences))
        initial_logp = to_host(self.logprob_fn(initial, sequences))
        return {"drift_kl": drift_kl(logp, initial_logp, np.asarray(ro.out.mask)[:rows])}
