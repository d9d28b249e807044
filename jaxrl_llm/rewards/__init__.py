"""Reward functions: one signature for all, `(prompts, completions, **fields) -> list[float]`.

`fields` are the prompt records' columns (e.g. `answer`) as lists, plus `completion_lengths` (tokens) and
`max_new_tokens`. A function is a built-in name (`REWARD_FUNCTIONS`) or `"module:function"`. Functions are
called once per batch, never once per completion.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.rewards.math_answers import math_answer_reward, math_verify_reward
from jaxrl_llm.rewards.shaping import format_reward, overlong_reward


def _reward_model_reward(prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> list[float]:
    from jaxrl_llm.models.reward_model import reward_model_reward

    return reward_model_reward(prompts, completions, **fields)


RewardFunction = Callable[..., Sequence[float]]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_answer": math_answer_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
    "overlong": overlong_reward,
    "reward_model": _reward_model_reward,  # kwargs: {path: DIR_OR_HUB_ID of a ...ForSequenceClassification}
}


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


def resolve_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFunction:
    """A built-in by name, or `module:function` imported; `kwargs` bound as keywords."""
    if name in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise RewardError(f"reward function {name!r} cannot be imported: {e}") from e
    else:
        raise RewardError(
            f"unknown reward function {name!r}: use one of {', '.join(REWARD_FUNCTIONS)} or 'module:function'"
        )
    return functools.partial(fn, **kwargs) if kwargs else fn


def compute_rewards(
    functions: Sequence[tuple[str, RewardFunction, float]],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: dict[str, Sequence[Any]],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted sum of the reward functions `(name, fn, weight)` -> `(total [N], {name: rewards [N]})`.

    Raises `RewardError` naming the function that raised, returned the wrong length or a non-finite value.
    """
    n = len(completions)
    total = np.zeros(n, np.float32)
    each: dict[str, np.ndarray] = {}
    for name, fn, weight in functions:
        try:
            values = fn(list(prompts), list(completions), **fields)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward function {name!r} must return a list of numbers: {e}") from e
        if len(values) != n:
            raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"reward function {name!r} returned a non-finite reward")
        each[name] = np.asarray(values, np.float32)
        total += weight * each[name]
    return total, each
