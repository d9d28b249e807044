"""Held-out evaluation: greedy completions scored by a reward function (accuracy = share scoring 1)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.data import PromptSet, bucket, left_pad
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.rewards import RewardFunction, call_reward
from jaxrl_llm.sampling import SampleOutput, SamplingConfig, sample
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


def evaluate_greedy(
    params: Params,
    model_config: ModelConfig,
    tokenizer: Any,
    prompt_set: PromptSet,
    reward: tuple[str, RewardFunction],
    sampling: SamplingConfig,
    *,
    batch_size: int = 256,
    limit: int | None = None,
    mesh: Mesh | None = None,
) -> dict[str, float]:
    """`{"eval/accuracy", "eval/<reward>"}` over the first `limit` prompts, greedy decoding.

    Every batch is padded to `batch_size` rows so all evaluation calls reuse one compiled sampler.
    """
    name, fn = reward
    n = len(prompt_set) if not limit else min(limit, len(prompt_set))
    width = bucket(max(len(prompt_set.token_ids[i]) for i in range(n)), sampling.prompt_bucket)
    scores: list[float] = []
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        rows = [prompt_set.token_ids[i] for i in idx]
        rows += [rows[0]] * (min(batch_size, n) - len(rows))
        tokens, mask = left_pad(rows, width, sampling.pad_id)
        out = to_host(sample(params, model_config, tokens, mask, jax.random.key(0), sampling, mesh=mesh))
        out = SampleOutput(*[x[: len(idx)] for x in out])
        records = [prompt_set.records[i] for i in idx]
        fields = reward_fields(records, out, sampling.max_new_tokens)
        values, _ = call_reward(name, fn, [prompt_set.texts[i] for i in idx], decode_completions(tokenizer, out),
                                fields)
        scores.extend(values.tolist())
    values = np.asarray(scores, np.float64)
    return {"eval/accuracy": float((values == 1.0).mean()), f"eval/{name}": float(values.mean())}
