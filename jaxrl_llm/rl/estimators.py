"""Which advantage a rollout gets: a registry of estimators over the functions of `advantages.py`.

Every estimator has one signature,

    fn(rewards [N], mask [N, T], old_logp [N, T], ref_logp [N, T], *, group_size, scale, beta, kl_estimator)
        -> advantages [N, T] float32 (0 at padding)

and is registered under a name (`register_estimator`); the config's `rl.estimator` picks it, and config
validation lists the registered names. GRPO, RLOO and REINFORCE++ share the trainer's loop and differ only
here (and in where the KL to the reference goes: `kl_in_reward=True` puts `-beta * KL_t` into the token
rewards, as REINFORCE++ does, and takes it out of the loss). `docs/extending.md` adds one from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.rl import advantages as adv
from jaxrl_llm.rl.kl import KLEstimator, kl_penalty, kl_shaped_token_rewards
from jaxrl_llm.rl.reductions import masked_mean
from jaxrl_llm.rl.value_loss import explained_variance

EstimatorFn = Callable[..., jax.Array]


class AdvantageEstimator(NamedTuple):
    fn: EstimatorFn
    kl_in_reward: bool = False  # True: the KL to the reference is in the token rewards, not in the loss
    needs_values: bool = False  # True: a critic's values `[N, T]` come as `values=` (PPO's GAE)
    compares_group: bool = False  # True: a sample's advantage is against its group's others (needs >= 2 per prompt)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(name: str, *, kl_in_reward: bool = False, needs_values: bool = False,
                       compares_group: bool = False) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: `@register_estimator("name")` makes `fn` (the signature above) a choice of `rl.estimator`."""
    def add(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, kl_in_reward, needs_values, compares_group)
        return fn

    return add


def _broadcast(per_seq: jax.Array, mask: jax.Array) -> jax.Array:
    return per_seq[:, None] * mask.astype(jnp.float32)


@register_estimator("grpo", compares_group=True)
def grpo_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                   group_size: int, scale: str = "group", beta: float = 0.0, kl_estimator: str = "k1") -> jax.Array:
    """`(r_i - mean_group r) / (std + eps)` (`scale` = group / batch / none), broadcast over valid tokens."""
    return _broadcast(adv.group_normalized_advantages(rewards, group_size=group_size, scale=scale), mask)  # type: ignore[arg-type]


@register_estimator("rloo", compares_group=True)
def rloo_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                   group_size: int, scale: str = "group", beta: float = 0.0, kl_estimator: str = "k1") -> jax.Array:
    """`r_i - mean_{j != i} r_j` over the group, broadcast over valid tokens."""
    return _broadcast(adv.rloo_advantages(rewards, group_size=group_size), mask)


@register_estimator("reinforce_pp", kl_in_reward=True)
def reinforce_pp_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                           group_size: int, scale: str = "group", beta: float = 0.0,
                           kl_estimator: str = "k1") -> jax.Array:
    """Token rewards `r_t = -beta * KL_t + [t = last] * r_i` (KL of the rollout's log-probs against the
    reference, `kl_estimator`), returns-to-go, whitened over the batch's valid tokens."""
    token_rewards = kl_shaped_token_rewards(rewards, old_logp, ref_logp, mask, kl_coef=beta,
                                            estimator=kl_estimator)  # type: ignore[arg-type]
    return adv.reinforce_plus_plus_advantages(token_rewards, mask)


@register_estimator("reinforce_pp_baseline", compares_group=True)
def reinforce_pp_baseline_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array,
                                    *, group_size: int, scale: str = "group", beta: float = 0.0,
                                    kl_estimator: str = "k1") -> jax.Array:
    """`r_i - mean_group r`, broadcast, whitened over the batch's valid tokens."""
    return adv.reinforce_plus_plus_baseline_advantages(rewards, mask, group_size=group_size)


class PPOTargets(NamedTuple):
    """What a PPO rollout turns into before the updates; every field `[N, T]` float32, 0 at padding.

    kl: `KL_t` per token (old policy vs reference); token_rewards: `r_t`; advantages: `A_t` (whitened if
    asked); returns: `R_t = A_t + V_t` (from the raw, un-whitened advantages): the critic's target.
    """

    kl: jax.Array
    token_rewards: jax.Array
    advantages: jax.Array
    returns: jax.Array


def ppo_targets(scores: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, values: jax.Array, mask: jax.Array,
                kl_coef: jax.Array | float, *, gamma: float = 1.0, lam: float = 0.95, kl_estimator: KLEstimator = "k1",
                whiten_advantages: bool = True) -> PPOTargets:
    """Per-token rewards, GAE advantages and returns of one rollout (Ziegler et al. 2019; Schulman et al. 2016).

    ::

        KL_t  = kl_penalty(old_logp, ref_logp)             k1: log pi_old(y_t) - log pi_ref(y_t)
        r_t   = -kl_coef * KL_t + [t = last valid] * score
        delta_t = r_t + gamma * V_{t+1} - V_t               (V after the last token = 0)
        A_t   = delta_t + gamma * lam * A_{t+1},   R_t = A_t + V_t
        A_t   <- (A_t - mean A) / sqrt(var A + 1e-8)         over all valid tokens, if whiten_advantages

    Shapes: `scores [N]`; `old_logp, ref_logp, values, mask [N, T]`; `kl_coef` a scalar (may be traced).
    """
    kl = kl_penalty(old_logp, ref_logp, estimator=kl_estimator, mask=mask)
    token_rewards = kl_shaped_token_rewards(scores, old_logp, ref_logp, mask, kl_coef=kl_coef, estimator=kl_estimator)
    advantages, returns = adv.gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = adv.masked_whiten(advantages, mask)
    return PPOTargets(kl, token_rewards, advantages, returns)


@register_estimator("gae", kl_in_reward=True, needs_values=True)
def gae_estimator(rewards: jax.Array, mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, *,
                  group_size: int, scale: str = "group", beta: float = 0.0, kl_estimator: str = "k1",
                  values: jax.Array, gamma: float = 1.0, lam: float = 0.95) -> jax.Array:
    """PPO's advantages: `ppo_targets(...).advantages` with `kl_coef = beta`, whitened (needs the critic's
    `values [N, T]`)."""
    return ppo_targets(rewards, old_logp, ref_logp, values, mask, beta, gamma=gamma, lam=lam,
                       kl_estimator=kl_estimator).advantages  # type: ignore[arg-type]


def rollout_value_metrics(targets: PPOTargets, values: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Scalars of a rollout before any update: `kl` (mean per token), `returns/mean`, `values/mean`,
    `explained_variance` of the rollout's values against the returns, `token_reward/sum_mean` (mean over
    sequences of sum_t r_t). Shapes: `values, mask [N, T]`."""
    valid = mask.astype(jnp.float32)
    has_tokens = (valid.sum(axis=-1) > 0).astype(jnp.float32)
    return {
        "kl": masked_mean(targets.kl, mask),
        "returns/mean": masked_mean(targets.returns, mask),
        "values/mean": masked_mean(values, mask),
        "explained_variance": explained_variance(values, targets.returns, mask),
        "token_reward/sum_mean": (targets.token_rewards * valid).sum() / jnp.maximum(has_tokens.sum(), 1.0),
    }


def kl_in_reward(estimator: str) -> bool:
    """Whether the estimator puts `-beta * KL_t` into the token rewards (then the loss carries no KL)."""
    return _lookup(estimator).kl_in_reward


def needs_values(estimator: str) -> bool:
    """Whether the estimator needs a critic's values (only PPO has one)."""
    return _lookup(estimator).needs_values


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
    **critic: jax.Array | float,
) -> jax.Array:
    """Per-token advantages `[N, T]` of a group-major rollout from the registered `estimator`; `critic` are the
    extra keywords of an estimator registered with `needs_values` (`values [N, T]`, and GAE's `gamma`, `lam`).

    Shapes: `rewards [N]`, `mask, old_logp, ref_logp [N, T]` -> `[N, T]` float32 (0 at padding).
    """
    entry = _lookup(estimator)
    if entry.needs_values and "values" not in critic:
        raise ValueError(f"advantage estimator {estimator!r} needs a critic's values=[N, T]")
    return entry.fn(rewards, mask, old_logp, ref_logp, group_size=group_size, scale=scale, beta=beta,
                    kl_estimator=kl_estimator, **critic)
