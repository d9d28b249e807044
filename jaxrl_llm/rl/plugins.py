"""Names a config gives for the RL math, resolved against the registries: a registered name, or a user's
`module:function` imported and registered under that name (so the jitted code looks it up like a built-in)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, register_estimator
from jaxrl_llm.rl.surrogates import POLICY_LOSSES, register_policy_loss


def resolve_name(key: str, name: str, registry: dict[str, Any], register: Callable[[str, Any], None],
                 doc: str = "docs/extending.md") -> str:
    """`name` if in `registry`; a `module:function` is imported and added with `register(name, fn)`; else a
    one-line `ConfigError` naming `key` (and the page `doc` that says how to write one)."""
    if name in registry:
        return name
    if ":" not in name:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(registry)}, or 'module:function' (see {doc})")
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={name!r} cannot be imported: {e}") from e
    register(name, fn)
    return name


def resolve_estimator(name: str) -> str:
    """`name` if registered (`ADVANTAGE_ESTIMATORS`); a `module:function` is imported and registered under that
    name (its `kl_in_reward` attribute, if any, says where the KL goes)."""

    def register(key: str, fn: Any) -> None:
        register_estimator(key, kl_in_reward=bool(getattr(fn, "kl_in_reward", False)))(fn)

    return resolve_name("rl.estimator", name, ADVANTAGE_ESTIMATORS, register)


def resolve_policy_loss(name: str) -> str:
    """`name` if registered (`POLICY_LOSSES`); a `module:function` is imported and registered."""
    return resolve_name("rl.policy_loss", name, POLICY_LOSSES, lambda key, fn: register_policy_loss(key)(fn))


def advantage_estimator(algo: str, estimator: str) -> str:
    """The estimator a run uses: `rl.estimator` if set, else the one named by `algo` (else GRPO's)."""
    if estimator:
        return resolve_estimator(estimator)
    return algo if algo in ADVANTAGE_ESTIMATORS else "grpo"
