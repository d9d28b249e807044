"""Fixed and random batches for the update tests: a policy batch with its model and optimizer, random rollouts
with the model's own log-probs, the loss options from flat keywords, and a small engine that exercises paging."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.engine import Engine
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.trainers.objectives import PolicyBatch
from tests.families import TINY


def with_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """`clipped_policy_loss`'s keywords from a flat dict: the `PolicyLossOptions` fields among them as `options=`."""
    from jaxrl_llm.rl import PolicyLossOptions

    names = {f.name for f in dataclasses.fields(PolicyLossOptions)}
    options = {k: v for k, v in keywords.items() if k in names}
    return {**{k: v for k, v in keywords.items() if k not in names}, "options": PolicyLossOptions(**options)}


def fixed_batch(config, n=8, p=6, t=5, seed=0):
    rng = np.random.default_rng(seed)
    pt = rng.integers(3, config.vocab_size, (n, p)).astype(np.int32)
    pm = np.ones((n, p), np.int32)
    pm[: n // 2, :2] = 0
    ct = rng.integers(3, config.vocab_size, (n, t)).astype(np.int32)
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]).astype(np.int32)
    adv = rng.normal(size=n).astype(np.float32)
    return pt, pm, ct, cm, adv


def fixed_update_setup():
    """A tiny random model, a fixed policy batch whose old log-probs are the model's own, and AdamW at 0.05."""
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.trainers.objectives import completion_logprobs

    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(1))
    pt, pm, ct, cm, adv = fixed_batch(config)
    old = completion_logprobs(params, config, Sequences(pt, pm, ct, cm))[0]
    optimizer, _ = make_optimizer(OptimSection(learning_rate=0.05, max_grad_norm=0.0), 10)
    return config, params, PolicyBatch(Sequences(pt, pm, ct, cm), old, jnp.zeros_like(old), adv), optimizer


def random_rollout(params: Any, config: Any, rng: np.random.Generator, n: int, p_len: int, t_len: int,
                   vocab: int = 32) -> tuple[np.ndarray, ...]:
    """`n` random left-padded prompts (2 to `p_len` tokens) and right-padded completions (1 to `t_len` tokens) of
    ids below `vocab`, and the model's log-probs of the completions: `(pt, pm, ct, cm, logp)`."""
    from jaxrl_llm.trainers.objectives import completion_logprobs

    pm = (np.arange(p_len)[None] >= p_len - rng.integers(2, p_len + 1, n)[:, None]).astype(np.int32)
    pt = np.where(pm, rng.integers(1, vocab, (n, p_len)), 0).astype(np.int32)
    cm = (np.arange(t_len)[None] < rng.integers(1, t_len + 1, n)[:, None]).astype(np.int32)
    ct = np.where(cm, rng.integers(1, vocab, (n, t_len)), 0).astype(np.int32)
    return pt, pm, ct, cm, np.asarray(completion_logprobs(params, config, Sequences(pt, pm, ct, cm))[0])


def small_engine(config, **overrides) -> Engine:
    """Small pages, fewer slots than rows and few steps per call, so admission, refills and page growth all run."""
    settings = dict(num_pages=96, page_size=4, slots=3, steps_per_call=5, prefill_chunk=8, prefill_rows=2)
    return Engine(config, **{**settings, **overrides})
