"""Which advantage a rollout gets: one pure dispatch over the estimators of `advantages.py`.

GRPO, RLOO and REINFORCE++ share the trainer's loop and differ only here (and in where the KL to the
reference goes: in the loss for GRPO / RLOO / REINFORCE++-baseline, in the per-token reward for REINFORCE++).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxrl_llm.rl.advantages import (
    group_normalized_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from jaxrl_llm.rl.losses import kl_shaped_token_rewards

Estimator = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def kl_in_reward(estimator: str) -> bool:
    """REINFORCE++ puts `-beta * KL_t` into the token rewards; the others put KL into the loss."""
    return estimator == "reinforce_pp"


def rollout_advantages(
    estimator: Estimator,
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
    """Per-token advantages `[N, T]` of a group-major rollout.

    - `grpo`: `(r_i - mean_group r) / (std + eps)` (`scale` = group / batch / none), broadcast over tokens.
    - `rloo`: `r_i - mean_{j != i} r_j` over the group, broadcast over tokens.
    - `reinforce_pp`: token rewards `r_t = -beta * KL_t + [t = last] * r_i` (KL from the rollout's
      log-probs against the reference, `kl_estimator`, k1 by default), returns-to-go, batch-whitened.
    - `reinforce_pp_baseline`: `r_i - mean_group r`, broadcast, batch-whitened over valid tokens.

    Shapes: `rewards [N]`, `mask, old_logp, ref_logp [N, T]` -> `[N, T]` float32 (0 at padding).
    """
    valid = mask.astype(jnp.float32)
    if estimator == "grpo":
        per_seq = group_normalized_advantages(rewards, group_size=group_size, scale=scale)  # type: ignore[arg-type]
    elif estimator == "rloo":
        per_seq = rloo_advantages(rewards, group_size=group_size)
    elif estimator == "reinforce_pp":
        token_rewards = kl_shaped_token_rewards(
            rewards, old_logp, ref_logp, mask, kl_coef=beta, estimator=kl_estimator  # type: ignore[arg-type]
        )
        return reinforce_plus_plus_advantages(token_rewards, mask)
    elif estimator == "reinforce_pp_baseline":
        return reinforce_plus_plus_baseline_advantages(rewards, mask, group_size=group_size)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")
    return per_seq[:, None] * valid
