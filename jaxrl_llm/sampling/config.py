"""What a sampler call is asked for: `SamplingConfig` (static: it shapes the compiled program, except the
`Knobs`, traced values that never recompile), what it returns (`SampleOutput`), and the length buckets."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample completions.

    - `max_new_tokens`: completion length limit `T` (the returned arrays have exactly `T` columns).
    - `temperature`, `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off): see the module docstring.
    - `greedy`: argmax decoding; temperature and truncation are then ignored.
    - `n`: samples per prompt, all sharing one prefill; output rows `i*n ... i*n+n-1` belong to prompt `i`.
    - `eos_ids`: a row stops after emitting any of these ids (the EOS is part of the completion, mask 1).
    - `pad_id`: fills completion slots after the stop.
    - `prompt_bucket`, `new_tokens_bucket`: the prompt length (longest row, after dropping all-padding
      columns) and `max_new_tokens` are rounded up to a multiple of these, and one program is compiled per
      rounded pair: e.g. with 64, any prompt of 1..64 tokens and any `max_new_tokens` of 1..64 share one
      program. 1 means exact lengths (a compile per distinct length).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = False
    n: int = 1
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 64
    new_tokens_bucket: int = 64

    def __post_init__(self) -> None:
        # Accept any iterable (a list from YAML, a single int) and store a hashable tuple.
        eos = (self.eos_ids,) if isinstance(self.eos_ids, int) else tuple(int(e) for e in self.eos_ids)
        object.__setattr__(self, "eos_ids", eos)
        errors = []
        if self.max_new_tokens < 1:
            errors.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            errors.append(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            errors.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.n < 1:
            errors.append(f"n must be >= 1, got {self.n}")
        if self.prompt_bucket < 1 or self.new_tokens_bucket < 1:
            errors.append(f"buckets must be >= 1, got {self.prompt_bucket}, {self.new_tokens_bucket}")
        if errors:
            raise ValueError("invalid SamplingConfig: " + "; ".join(errors))

    @property
    def uses_top_k(self) -> bool:
        return not self.greedy and self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return not self.greedy and self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return not self.greedy and self.min_p > 0.0


class SampleOutput(NamedTuple):
    """Completions, row `i*n + j` = sample `j` of prompt `i` (reshape to `[B, n, ...]` recovers groups).

    - `tokens [B*n, T]` int32: completion ids, right-padded with `pad_id` after the first EOS.
    - `mask [B*n, T]` int32: 1 up to and including the first EOS (or all `T` without one), else 0.
    - `logprobs [B*n, T]` float32: log-prob of each token under the distribution it was sampled from (after
      temperature and top-k/top-p/min-p truncation, renormalised); 0 in greedy mode and on masked slots.
    - `logprobs_untruncated [B*n, T]` float32: `log_softmax(logits / temperature)[token]` over the full
      vocabulary (temperature 1 in greedy mode): what a trainer recomputing `log_softmax(logits / T)` gets.
    - `lengths [B*n]` int32: number of completion tokens (`mask.sum(-1)`).
    - `stopped_on_eos [B*n]` bool: the row ended with an EOS id (False: it hit `max_new_tokens`).
    - `routing [B*n, P + T, L, k]` int16, an MoE model's only (else None): the experts each token of `prompt +
      completion` was routed to when the sampler fed it (prefill and decode; the prompt's `P` columns
      left-padded as the prompt batch), `moe.NO_RECORD` where nothing was fed: the record routing replay uses.
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    lengths: jax.Array
    stopped_on_eos: jax.Array
    routing: Any = None


class _Static(NamedTuple):
    """The part of a `SamplingConfig` that shapes the compiled program (hashable, a static jit argument)."""

    new_tokens: int  # T_b, the bucketed completion length
    greedy: bool
    top_k: bool
    top_p: bool
    min_p: bool
    n: int
    eos_ids: tuple[int, ...]
    pad_id: int


class Knobs(NamedTuple):
    """Traced sampling values (changing them never recompiles). Scalars; `top_k` is int32, the rest float32
    except `max_new_tokens` (int32)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    max_new_tokens: jax.Array


def knobs_from_config(sampling: SamplingConfig) -> Knobs:
    # Explicit dtypes: a Python int temperature must not trace differently from a float one.
    return Knobs(
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(sampling.top_k),
        top_p=np.float32(sampling.top_p),
        min_p=np.float32(sampling.min_p),
        max_new_tokens=np.int32(sampling.max_new_tokens),
    )


def bucket_length(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket` (at least one bucket)."""
    return max(1, math.ceil(length / bucket)) * bucket
