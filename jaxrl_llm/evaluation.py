"""Held-out evaluation: completions scored by a reward function (accuracy = share scoring 1).

    generate_scored(...)   -> Scored: every completion of every prompt with its reward, length, truncation
    evaluate_greedy(...)   -> {"eval/accuracy", "eval/<reward>"}: what a run logs (greedy, one per prompt)
    pass_at_k(n, c, k)     the unbiased pass@k estimator (Chen et al. 2021)
    summarize(scored, ks)  accuracy / pass@k / mean reward / mean length / truncation rate of a Scored
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm.data import PromptSet, bucket
from jaxrl_llm.engine import make_sampler
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.rewards import RewardFunction, call_reward
from jaxrl_llm.sampling import SampleOutput, Sampler, SamplingConfig
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import to_host


def decode_completions(tokenizer: Any, out: SampleOutput) -> list[str]:
    """Completion texts: the tokens under the mask (up to and including EOS), special tokens dropped."""
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    return tokenizer.batch_decode(
        [t[m.astype(bool)].tolist() for t, m in zip(tokens, mask, strict=True)], skip_special_tokens=True
    )


def reward_fields(records: list[dict[str, Any]], out: SampleOutput, max_new_tokens: int) -> dict[str, Any]:
    """Every record column as a list, plus completion lengths in tokens and the length limit."""
    keys = set().union(*(r.keys() for r in records))
    fields: dict[str, Any] = {k: [r.get(k) for r in records] for k in keys}
    fields["completion_lengths"] = np.asarray(out.lengths).tolist()
    fields["max_new_tokens"] = max_new_tokens
    return fields


@dataclasses.dataclass
class Scored:
    """`n` completions of each of `P` prompts, rows prompt-major (row `i*n + j` = sample `j` of prompt `i`)."""

    prompts: list[str]  # [P] rendered prompt texts
    records: list[dict[str, Any]]  # [P] the prompt records
    completions: list[str]  # [P*n]
    rewards: np.ndarray  # [P*n] float64
    lengths: np.ndarray  # [P*n] completion tokens
    truncated: np.ndarray  # [P*n] bool: hit max_new_tokens without EOS
    n: int

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready row per completion (what `eval` saves as completions.jsonl)."""
        return [{"prompt_index": i // self.n, "sample": i % self.n, "prompt": self.prompts[i // self.n],
                 "completion": c, "reward": float(self.rewards[i]), "length": int(self.lengths[i]),
                 "truncated": bool(self.truncated[i])} for i, c in enumerate(self.completions)]


def generate_scored(
    params: Params, model_config: ModelConfig, tokenizer: Any, prompt_set: PromptSet,
    reward: tuple[str, RewardFunction], sampling: SamplingConfig, *, batch_size: int = 256, limit: int | None = None,
    key: jax.Array | None = None, sampler: Sampler | None = None,
) -> Scored:
    """Sample `sampling.n` completions for each of the first `limit` prompts and score them with `reward`.

    Every batch is padded to `batch_size` prompts so all calls reuse one compiled sampler; batch `b` samples
    with `fold_in(key, b)` (`key` default `key(0)`; greedy decoding ignores it). `sampler` (`sampling.Sampler`):
    how to sample, on the mesh `params` are placed on (a trainer's `Policy.sample`, which follows `sampling.engine`);
    default the rollout engine (`engine.make_sampler("paged", ...)`)."""
    name, fn = reward
    sampler = sampler if sampler is not None else make_sampler("paged", model_config)
    key = jax.random.key(0) if key is None else key
    n = len(prompt_set) if not limit else min(limit, len(prompt_set))
    if n == 0:
        raise ValueError("no prompts to evaluate (the prompt set is empty)")
    width = bucket(max(len(prompt_set.token_ids[i]) for i in range(n)), sampling.prompt_bucket)
    k = sampling.n
    completions: list[str] = []
    scores: list[float] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for b, start in enumerate(range(0, n, batch_size)):
        idx = np.arange(start, min(start + batch_size, n))
        rows = [prompt_set.token_ids[i] for i in idx]
        rows += [rows[0]] * (min(batch_size, n) - len(rows))
        tokens, mask = left_pad(rows, width, sampling.pad_id)
        batch_key = key if b == 0 else jax.random.fold_in(key, b)
        out = to_host(sampler(params, tokens, mask, batch_key, sampling))
        out = SampleOutput(*[None if x is None else x[: len(idx) * k] for x in out])
        records = [prompt_set.records[i] for i in idx for _ in range(k)]
        fields = reward_fields(records, out, sampling.max_new_tokens)
        texts = decode_completions(tokenizer, out)
        values, _ = call_reward(name, fn, [prompt_set.texts[i] for i in idx for _ in range(k)], texts, fields)
        completions += texts
        scores += values.tolist()
        lengths += np.asarray(out.lengths).tolist()
        truncated += (~np.asarray(out.stopped_on_eos, bool)).tolist()
    return Scored([prompt_set.texts[i] for i in range(n)], [prompt_set.records[i] for i in range(n)], completions,
                  np.asarray(scores, np.float64), np.asarray(lengths), np.asarray(truncated, bool), k)


def evaluate_greedy(
    params: Params, model_config: ModelConfig, tokenizer: Any, prompt_set: PromptSet,
    reward: tuple[str, RewardFunction], sampling: SamplingConfig, *, batch_size: int = 256, limit: int | None = None,
    sampler: Sampler | None = None,
) -> dict[str, float]:
    """`{"eval/accuracy", "eval/<reward>"}` over the first `limit` prompts, greedy decoding: the accuracy is
    the share of answers the reward scores exactly 1, the other the mean reward (`sampler`: as `generate_scored`)."""
    sampling = dataclasses.replace(sampling, greedy=True, n=1)
    scored = generate_scored(params, model_config, tokenizer, prompt_set, reward, sampling, batch_size=batch_size,
                             limit=limit, sampler=sampler)
    return {"eval/accuracy": float((scored.rewards == 1.0).mean()), f"eval/{reward[0]}": float(scored.rewards.mean())}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al. 2021) from `n` samples of which `c` are correct:

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    (the probability that a random k-subset of the n samples holds at least one correct one; 1 when
    n - c < k). Computed as the product, which stays finite for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []
    return sorted(set(ks) | {n})


def summarize(scored: Scored, ks: Sequence[int] = ()) -> dict[str, float]:
    """The metrics of a `Scored` set. Correct = reward exactly 1.

        accuracy            share of all completions that are correct (greedy: the run's eval/accuracy)
        pass@k              mean over prompts of `pass_at_k(n, c_prompt, k)` for each k in `ks` (k <= n)
        reward/mean         mean reward;  completion_length/mean: mean tokens;  frac_truncated: share cut
    """
    correct = (scored.rewards == 1.0).reshape(-1, scored.n).sum(axis=1)
    out = {"accuracy": float((scored.rewards == 1.0).mean())}
    for k in ks:
        if k <= scored.n:
            out[f"pass@{k}"] = float(np.mean([pass_at_k(scored.n, int(c), k) for c in correct]))
    out.update({"reward/mean": float(scored.rewards.mean()),
                "completion_length/mean": float(scored.lengths.mean()),
                "frac_truncated": float(scored.truncated.mean()),
                "prompts": float(len(scored.prompts)), "samples_per_prompt": float(scored.n)})
    return out
