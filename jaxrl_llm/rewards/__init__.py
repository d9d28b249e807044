"""Reward functions: one signature for all, `(prompts, completions, **fields) -> list[float]`.

`fields` are the prompt records' columns (e.g. `answer`) as lists, plus `completion_lengths` (tokens) and
`max_new_tokens`. A function is a built-in name (`REWARD_FUNCTIONS`) or `"module:function"`. Functions are
called once per batch, never once per completion, each call within `rewards[].timeout_s` (default
`DEFAULT_TIMEOUT_S`), with a notice on stderr once it has run `NOTICE_AFTER_S`.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.errors import RewardError, RewardNameError, one_line
from jaxrl_llm.models.reward_model import reward_model_reward
from jaxrl_llm.registry import import_named
from jaxrl_llm.rewards.code_execution import code_tests_reward
from jaxrl_llm.rewards.math_answers import math_answer_reward, math_verify_reward
from jaxrl_llm.rewards.shaping import format_reward, overlong_reward
from jaxrl_llm.tasks.reasoning_gym import reasoning_gym_reward


def _reward_model_reward(prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> list[float]:

    return reward_model_reward(prompts, completions, **fields)


RewardFunction = Callable[..., Sequence[float]]

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "math_answer": math_answer_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
    "overlong": overlong_reward,
    "reward_model": _reward_model_reward,  # kwargs: {path: DIR_OR_HUB_ID of a ...ForSequenceClassification}
    "code_tests": code_tests_reward,  # the record's unit tests run against the completion's code, sandboxed
    # reasoning-gym's own scorer of the task a reasoning_gym:NAME record came from (jaxrl_llm/tasks/reasoning_gym.py)
    "reasoning_gym": reasoning_gym_reward,
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
        fn = import_named(name, "rewards[].name", RewardNameError)
    else:
        raise RewardNameError(
            f"unknown reward function {name!r}: use one of {', '.join(REWARD_FUNCTIONS)} or 'module:function'"
        )
    return functools.partial(fn, **kwargs) if kwargs else fn


# The default of rewards[].timeout_s (config.RewardSpec), and the limit of callers that name none (the held-out
# evaluation): a stalled function stops the run with one line instead of holding it forever.
DEFAULT_TIMEOUT_S = 300.0
# A call still running after this many seconds prints one notice on stderr, so a slow or stalled function is
# never silent while the run waits for it (tests lower it).
NOTICE_AFTER_S = 10.0

# Functions found to install signal handlers (math-verify's signal.alarm timeouts), which Python allows only in
# the main thread: they run in the caller's thread, without the time limit (theirs applies).
_MAIN_THREAD_ONLY: set[str] = set()


class _NeedsMainThread(Exception):
    """The function failed in the worker thread only because it installs a signal handler."""


def call_reward(name: str, fn: RewardFunction, prompts: Sequence[str], completions: Sequence[str],
                fields: dict[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[np.ndarray, float]:
    """`(rewards [N] float32, seconds)` of one reward function, checked: it must return a sequence (list,
    tuple or 1-D array) of exactly N finite real numbers. Anything else, an exception, or a call longer than
    `timeout_s` (> 0; 0 = no limit) raises `RewardError` naming the function; a call longer than
    `NOTICE_AFTER_S` prints a notice on stderr."""
    n = len(completions)
    t0 = time.perf_counter()
    values = _call_watched(name, fn, list(prompts), list(completions), fields, timeout_s)
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


def _notice(name: str, n: int, limit: str) -> None:
    print(f"jaxrl_llm: reward function {name!r} has run for {NOTICE_AFTER_S:g} s on {n} completions and not "
          f"returned yet ({limit})", file=sys.stderr, flush=True)


def _call_watched(name: str, fn: RewardFunction, prompts: list[str], completions: list[str],
                  fields: dict[str, Any], timeout_s: float) -> Any:
    """`fn`'s output: in a worker thread the caller waits on for at most `timeout_s` (> 0), else in the caller's
    thread; either way a notice on stderr once the call has run `NOTICE_AFTER_S`."""
    if timeout_s > 0 and name not in _MAIN_THREAD_ONLY:
        try:
            return _call_with_timeout(name, fn, prompts, completions, fields, timeout_s)
        except _NeedsMainThread:
            _MAIN_THREAD_ONLY.add(name)
            print(f"jaxrl_llm: reward function {name!r} installs signal handlers (e.g. math-verify's timeouts), "
                  f"which work only in the main thread: it runs there, without rewards[].timeout_s="
                  f"{timeout_s:g} s", file=sys.stderr, flush=True)
    limit = ("rewards[].timeout_s=0: no time limit" if timeout_s <= 0 else
             "it runs in the main thread, without rewards[].timeout_s: it installs signal handlers")
    # The caller's thread runs `fn`; a timer thread (cancelled when `fn` returns) prints the notice.
    timer = threading.Timer(NOTICE_AFTER_S, _notice, (name, len(completions), limit))
    timer.daemon = True
    timer.start()
    try:
        return fn(prompts, completions, **fields)
    except Exception as e:
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {one_line(str(e))}") from e
    finally:
        timer.cancel()


def _signal_in_thread(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) is Python's refusal of a signal handler off the main
    thread; math-verify re-raises it as its own ValueError."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ValueError) and "signal only works in main thread" in str(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _call_with_timeout(name: str, fn: RewardFunction, prompts: list[str], completions: list[str],
                       fields: dict[str, Any], timeout_s: float) -> Any:
    """Run `fn` in a daemon thread and wait at most `timeout_s`: a hung function cannot hold the run (nor
    its exit), though Python cannot stop the thread itself. The waiting thread prints the notice: no polling."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(prompts, completions, **fields)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    deadline = time.monotonic() + timeout_s
    thread = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
    thread.start()
    if timeout_s > NOTICE_AFTER_S:
        thread.join(NOTICE_AFTER_S)
        if thread.is_alive():
            _notice(name, len(completions), f"rewards[].timeout_s={timeout_s:g} s stops the run after that")
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise RewardError(f"reward function {name!r} did not return within rewards[].timeout_s={timeout_s:g} s "
                          f"({len(completions)} completions); the run stops, its checkpoints are kept")
    if "error" in result:
        e = result["error"]
        if _signal_in_thread(e) and threading.current_thread() is threading.main_thread():
            raise _NeedsMainThread from e
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {one_line(str(e))}") from e
    return result["value"]


def compute_rewards(
    functions: Sequence[tuple[Any, ...]],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: dict[str, Sequence[Any]],
    timings: dict[str, float] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted sum of the reward functions `(name, fn, weight[, timeout_s])` -> `(total [N], {name: [N]})`;
    without a `timeout_s`, `DEFAULT_TIMEOUT_S`.

    Each output is checked by `call_reward`; `timings`, when given, receives each function's seconds.
    """
    total = np.zeros(len(completions), np.float32)
    each: dict[str, np.ndarray] = {}
    for name, fn, weight, *rest in functions:
        each[name], seconds = call_reward(name, fn, prompts, completions, fields,
                                          timeout_s=float(rest[0]) if rest else DEFAULT_TIMEOUT_S)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + seconds
        total += weight * each[name]
    return total, each
