"""Which advantage a rollout gets: a registry of estimators over the functions of `advantages.py`.

Every estimator has one signature,

    fn(rewards [N], mask [N, T], old_logp [N, T], ref_logp [N, T], *, group_size, scale, beta, kl_estimator)
        -> advantages [N, T] float32 (0 at padding)

and is registered under a name (`register_estimator`); the config's `grpo.estimator` picks it, and config
validation lists the registered names. GRPO, RLOO and REINFORCE++ share the trainer's loop and differ only
here (and in where the KL to the reference goes: `kl_in_reward=True` puts `-beta * KL_t` into the token
rewards, as REINFORCE++ does, and takes it out of the loss). `docs/extending.md` adds one from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.rl.advantages import (
    group_normalized_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from jaxrl_llm.rl.losses import kl_shaped_token_rewards

EstimatorFn = Callable[..., jax.Array]


class AdvantageEstimator(NamedTuple):
    fn: EstimatorFn
    kl_in_reward: bool = False  # True: the KL to the reference is in the token rewards, not in the loss


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(name: str, *, kl_in_reward: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: `@register_estimator("name")` makes `fn` (the signature above) a choice of `grpo.estimator`."""
    def add(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, kl_in_reward)
        return fn

    return add


def _broadcast(per_seq: jax.Array, mask: jax.Array) -> jax.Array:
    return per_seq[:, None] * mask.astype(jnp.float32)


@register_estimator("grpo")
def grpo_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                   group_size: int, scale: str = "group", beta: float = 0.0, kl_estimator: str = "k1") -> jax.Array:
    """`(r_i - mean_group r) / (std + eps)` (`scale` = group / batch / none), broadcast over valid tokens."""
    return _broadcast(group_normalized_advantages(rewards, group_size=group_size, scale=scale), mask)  # type: ignore[arg-type]


@register_estimator("rloo")
def rloo_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                   group_size: int, scale: str = "group", beta: float = 0.0, kl_estimator: str = "k1") -> jax.Array:
    """`r_i - mean_{j != i} r_j` over the group, broadcast over valid tokens."""
    return _broadcast(rloo_advantages(rewards, group_size=group_size), mask)


@register_estimator("reinforce_pp", kl_in_reward=True)
def reinforce_pp_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                           group_size: int, scale: str = "group", beta: float = 0.0,
                           kl_estimator: str = "k1") -> jax.Array:
    """Token rewards `r_t = -beta * KL_t + [t = last] * r_i` (KL of the rollout's log-probs against the
    reference, `kl_estimator`), returns-to-go, whitened over the batch's valid tokens."""
    token_rewards = kl_shaped_token_rewards(rewards, old_logp, ref_logp, mask, kl_coef=beta,
                                            estimator=kl_estimator)  # type: ignore[arg-type]
    return reinforce_plus_plus_advantages(token_rewards, mask)


@register_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array,
                                    *, group_size: int, scale: str = "group", beta: float = 0.0,
                                    kl_estimator: str = "k1") -> jax.Array:
    """`r_i - mean_group r`, broadcast, whitened over the batch's valid tokens."""
    return reinforce_plus_plus_baseline_advantages(rewards, mask, group_size=group_size)


def kl_in_reward(estimator: str) -> bool:
    """Whether the estimator puts `-beta * KL_t` into the token rewards (then the loss carries no KL)."""
    return _lookup(estimator).kl_in_reward


def _lookup(estimator: str) -> AdvantageEstimator:
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator]


def rollout_advantages(
    estimator: str,
    rewards: jax.Array,
    mask: jax.Array,
    old_logp: jax.Array,
    ref_logp: jax.Array,
    *,
    group_size: int,
    scale: str = "group",
    beta: float = 0.0,
    kl_estimator: str = "k1",
) -> jax.Array:
    """Per-token advantages `[N, T]` of a group-major rollout from the registered `estimator`.

    Shapes: `rewards [N]`, `mask, old_logp, ref_logp [N, T]` -> `[N, T]` float32 (0 at padding).
    """
    return _lookup(estimator).fn(rewards, mask, old_logp, ref_logp, group_size=group_size, scale=scale, beta=beta,
                                 kl_estimator=kl_estimator)
