"""The trainers' optimizer: AdamW with warmup and decay, global-norm clipping, a guard against non-finite updates, and
parameters that get no update (`model.freeze_router`). A leaf the trainers and the memory planner share (the planner
plans this optimizer's state without importing the trainers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.config import OptimSection
from jaxrl_llm.sharding import path_string


def make_optimizer(cfg: OptimSection, total_updates: int, frozen: Callable[[str], bool] | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warmup then constant / cosine / linear decay, global-norm clipping, and a guard that skips
    any update whose gradients are not finite (`optax.apply_if_finite`) instead of corrupting the params.
    `frozen(path)`: parameters (by "/"-joined path) that get no update at all, neither gradient step nor weight
    decay, and are left out of the clipping norm (`model.freeze_router`: `router_frozen`)."""
    decay_steps = max(total_updates - cfg.warmup_steps, 1)
    end = cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.end_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.learning_rate, end, decay_steps)
    else:
        decay = optax.constant_schedule(cfg.learning_rate)
    schedule = (
        optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps), decay],
                             [cfg.warmup_steps])
        if cfg.warmup_steps
        else decay
    )
    chain = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    chain.append(optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay))
    if frozen is not None:  # zero gradients in (no moments, no share of the clipping norm), zero updates out
        chain = [zeroed(frozen), *chain, zeroed(frozen)]  # (the second: AdamW's weight decay)
    return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=1_000_000), schedule


def zeroed(frozen: Callable[[str], bool]) -> optax.GradientTransformation:
    """A stateless transform that sets the updates of the parameters `frozen(path)` selects to 0 (the optimizer
    state keeps the parameters' structure, so it shards and checkpoints as an unfrozen run's)."""
    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return jax.tree_util.tree_map_with_path(
            lambda p, u: jnp.zeros_like(u) if frozen(path_string(p)) else u, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def router_frozen(freeze: bool) -> Callable[[str], bool] | None:
    """`make_optimizer`'s `frozen` for `model.freeze_router`: an MoE model's router kernels (None: nothing frozen)."""
    return (lambda path: "mlp/router/" in path) if freeze else None
