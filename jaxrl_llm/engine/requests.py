"""The rollout engine's host records: a request (a prompt and its samples, or a conversation's next turn), a
completion, a conversation kept in the pool between turns, a sample while it decodes, and the counters of a call."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass
class Conversation:
    """A finished sequence's context kept in the pool: every token so far (`tokens`; the last one sampled but not
    yet written), and the pages holding the first `written` of them."""

    tokens: list[int]
    pages: list[int]
    written: int
    experts: np.ndarray | None = None  # an MoE model's record of every written token's experts `[written, L, k]`


@dataclasses.dataclass
class Request:
    """`n` samples of `tokens` (a prompt; or, with `conversation`, the tokens that follow it), keyed by `key`
    (sample j draws with `fold_in(key, j)`), each up to `max_new_tokens`. `key`: a `jax.random.key`, or its key data
    (`uint32 [2]`, numpy: what `prompt_requests` passes, so many requests cost no device call each)."""

    tokens: list[int]
    key: jax.Array | np.ndarray
    n: int = 1
    max_new_tokens: int | None = None
    conversation: Conversation | None = None


@dataclasses.dataclass
class Completion:
    """One sample: its tokens, their log-probs (as sampled, and untruncated), whether it stopped on EOS, its
    conversation when kept, and for an MoE model the experts every token of its context was routed to as it was
    written (prefill and decode: `[context - 1, L, k]` int16, the last sampled token never being fed; with a
    conversation, from its first turn on), the record routing replay uses."""

    tokens: list[int]
    logprobs: list[float]
    untruncated: list[float]
    stopped_on_eos: bool
    conversation: Conversation | None = None
    experts: np.ndarray | None = None


@dataclasses.dataclass
class Sequence:
    """A sample while it decodes: its request's result index, its key, its context, its pages and reservation, the
    tokens it may still sample, its completion so far and (MoE) the records of its written tokens."""

    result: int  # index into the results
    key_data: np.ndarray  # [2] uint32
    context: list[int]  # every token so far, the last one sampled and not yet written
    pages: list[int]
    reserved: int  # pages still reserved for its growth
    remaining: int  # tokens it may still sample
    completion: Completion
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # MoE: records of its written tokens


@dataclasses.dataclass
class EngineStats:
    """Counters of the last `generate`: prompt tokens prefilled, decode calls, pages shared by forks, the pool's
    peak pages in use."""

    prefilled_tokens: int = 0
    decode_calls: int = 0
    shared_pages: int = 0
    peak_pages: int = 0
