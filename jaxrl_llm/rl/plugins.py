"""Names a config gives for the RL math, resolved against the registries: a registered name, or a user's
`module:function` imported and registered under that name (so the jitted code looks it up like a built-in)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.registry import resolve_name
from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, register_estimator
from jaxrl_llm.rl.surrogates import POLICY_LOSSES, register_policy_loss


def resolve_estimator(name: str) -> str:
    """`name` if registered (`ADVANTAGE_ESTIMATORS`); a `module:function` is imported and registered under that
    name (its `kl_in_reward` attribute, if any, says where the KL goes)."""

    def register(key: str, fn: Any) -> None:
        register_estimator(key, kl_in_reward=bool(getattr(fn, "kl_in_reward", False)))(fn)

    return resolve_name("rl.estimator", name, ADVANTAGE_ESTIMATORS, register)


def resolve_policy_loss(name: str) -> str:
    """`name` if registered (`POLICY_LOSSES`); a `module:function` is imported and registered."""
    return resolve_name("rl.policy_loss", name, POLICY_LOSSES, lambda key, fn: register_policy_loss(key)(fn))


def advantage_estimator(own: str, estimator: str) -> str:
    """The estimator a run uses: `rl.estimator` if set, else the algorithm's `own` (`algorithms.py`; else GRPO's)."""
    if estimator:
        return resolve_estimator(estimator)
    return own or "grpo"
