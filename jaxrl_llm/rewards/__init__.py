"""Reward functions: one signature for all, `(prompts, completions, **fields) -> list[float]`.

`fields` are the prompt records' columns (e.g. `answer`) as lists, plus `completion_lengths` (tokens) and
`max_new_tokens`. A function is a built-in name (`REWARD_FUNCTIONS`) or `"module:function"`. Functions are
called once per batch, never once per completion.
"""

from __future__ import annotations

import functools
import importlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.errors import RewardError, RewardNameError, one_line
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

# Functions handed over in Python (`jaxrl_llm.train(reward_funcs=[fn])`), by the name their config entry uses.
PYTHON_REWARDS: dict[str, RewardFunction] = {}


def register_reward(fn: RewardFunction, name: str = "") -> str:
    """Make the callable `fn` a reward function named `name` (default: its `__name__`); returns the name.
    A built-in's name raises `RewardNameError`; registering a name again replaces its function."""
    name = name or getattr(fn, "__name__", "") or type(fn).__name__
    if not callable(fn):
        raise RewardNameError(f"reward function {name!r} is a {type(fn).__name__}, not a callable")
    if name in REWARD_FUNCTIONS or ":" in name:
        raise RewardNameError(f"reward function name {name!r} is taken (built-ins: {', '.join(REWARD_FUNCTIONS)}); "
                              f"give the function another name")
    PYTHON_REWARDS[name] = fn
    return name


def resolve_reward(name: str, kwargs: dict[str, Any] | None = None) -> RewardFunction:
    """A built-in by name, a registered Python function, or `module:function` imported; `kwargs` bound as
    keywords."""
    if name in REWARD_FUNCTIONS:
        fn = REWARD_FUNCTIONS[name]
    elif name in PYTHON_REWARDS:
        fn = PYTHON_REWARDS[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise RewardNameError(f"reward function {name!r} cannot be imported: {e}") from e
    else:
        raise RewardNameError(
            f"unknown reward function {name!r}: use one of {', '.join(REWARD_FUNCTIONS)} or 'module:function'"
        )
    return functools.partial(fn, **kwargs) if kwargs else fn


def call_reward(name: str, fn: RewardFunction, prompts: Sequence[str], completions: Sequence[str],
                fields: dict[str, Any], *, timeout_s: float = 0.0) -> tuple[np.ndarray, float]:
    """`(rewards [N] float32, seconds)` of one reward function, checked: it must return a sequence (list,
    tuple or 1-D array) of exactly N finite real numbers. Anything else, an exception, or a call longer than
    `timeout_s` (> 0) raises `RewardError` naming the function."""
    n = len(completions)
    t0 = time.perf_counter()
    if timeout_s > 0:
        values = _call_with_timeout(name, fn, list(prompts), list(completions), fields, timeout_s)
    else:
        try:
            values = fn(list(prompts), list(completions), **fields)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {one_line(str(e))}") from e
    seconds = time.perf_counter() - t0
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise RewardError(f"reward function {name!r} returned an array of shape {values.shape}; "
                              f"it must return {n} numbers, one per completion")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name!r} returned a {type(values).__name__}; it must return a list "
                          f"of {n} numbers, one per completion")
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise RewardError(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                              f"rewards must be real numbers")
        if not math.isfinite(float(v)):
            raise RewardError(f"reward function {name!r} returned a non-finite reward ({v}) for completion {i}")
    return np.asarray(values, np.float32), seconds


def _call_with_timeout(name: str, fn: RewardFunction, prompts: list[str], completions: list[str],
                       fields: dict[str, Any], timeout_s: float) -> Any:
    """Run `fn` in a daemon thread and wait at most `timeout_s`: a hung function cannot hold the run (nor
    its exit), though Python cannot stop the thread itself."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(prompts, completions, **fields)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardError(f"reward function {name!r} did not return within rewards[].timeout_s={timeout_s:g} s "
                          f"({len(completions)} completions); the run stops, its checkpoints are kept")
    if "error" in result:
        e = result["error"]
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {one_line(str(e))}") from e
    return result["value"]


def compute_rewards(
    functions: Sequence[tuple[Any, ...]],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: dict[str, Sequence[Any]],
    timings: dict[str, float] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted sum of the reward functions `(name, fn, weight[, timeout_s])` -> `(total [N], {name: [N]})`.

    Each output is checked by `call_reward`; `timings`, when given, receives each function's seconds.
    """
    total = np.zeros(len(completions), np.float32)
    each: dict[str, np.ndarray] = {}
    for name, fn, weight, *rest in functions:
        each[name], seconds = call_reward(name, fn, prompts, completions, fields,
                                          timeout_s=float(rest[0]) if rest else 0.0)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + seconds
        total += weight * each[name]
    return total, each
