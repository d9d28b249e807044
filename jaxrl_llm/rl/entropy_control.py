"""Entropy-coefficient controllers as pure ``state -> state`` functions (adaptive entropy control, Skywork-OR1).

The state is a ``NamedTuple`` pytree of float32 scalar arrays, like ``kl_control.KLControllerState``: it can live
in a jitted train state, be checkpointed, and its `applied_entropy_coef` is read as a traced ``entropy_coef`` by
the losses (``loss = ... - entropy_coef * aggregate(H)``).
"""

from typing import Literal, NamedTuple

import jax.numpy as jnp
from jax import Array

EntropyControllerKind = Literal["fixed", "adaptive"]


class EntropyControllerState(NamedTuple):
    """``coef``: the coefficient ``alpha`` the controller steers; ``active``: 1.0 while the entropy bonus is applied
    (the last measured entropy was below target), else 0.0. Both float32 scalars."""

    coef: Array
    active: Array


def init_entropy_controller(init_coef: float | Array) -> EntropyControllerState:
    """Controller state starting at ``alpha = init_coef`` with the bonus applied (Skywork-OR1's start)."""
    return EntropyControllerState(coef=jnp.asarray(init_coef, jnp.float32), active=jnp.ones((), jnp.float32))


def applied_entropy_coef(state: EntropyControllerState) -> Array:
    """The coefficient the next update's loss uses: ``alpha * active`` (float32 scalar)."""
    return state.coef * state.active


def fixed_entropy_update(state: EntropyControllerState, current_entropy: Array | float) -> EntropyControllerState:
    """Fixed controller: ``alpha`` never changes and the bonus stays as it is. Same signature as the adaptive one."""
    del current_entropy
    return state


def adaptive_entropy_update(
    state: EntropyControllerState,
    current_entropy: Array | float,
    *,
    target: float,
    delta: float,
    min_coef: float = 0.0,
    max_coef: float = 1.0,
) -> EntropyControllerState:
    """Adaptive entropy control of Skywork-OR1 (He et al. 2025, "Skywork Open Reasoner 1 Technical Report",
    arXiv:2505.22312, section "adaptive entropy control"; their ``EntController`` in ``verl/trainer/ppo/core_algos.py``;
    TRL's ``use_adaptive_entropy``)::

        below  = [H < target]
        alpha <- clip(alpha + delta if below else alpha - delta, min_coef, max_coef)
        active <- below                              the bonus -alpha * H enters the loss only while H < target

    ``current_entropy`` is the mean entropy per token measured during the last update (nats, the unit of
    ``target``); the coefficient rises by ``delta`` per step while the policy is below its target entropy and
    falls while it is above, and the bonus is switched off above the target so it cannot push entropy up without
    bound. (TRL compares with ``<=``; Skywork's code, followed here, with ``<``.) All scalars, float32.
    """
    if delta < 0 or min_coef > max_coef:
        raise ValueError(f"need delta >= 0 and min_coef <= max_coef, got delta={delta}, "
                         f"min_coef={min_coef}, max_coef={max_coef}")
    below = jnp.asarray(current_entropy, jnp.float32) < target
    step = jnp.where(below, jnp.float32(delta), jnp.float32(-delta))
    coef = jnp.clip(state.coef + step, min_coef, max_coef)
    return EntropyControllerState(coef=coef, active=below.astype(jnp.float32))


def entropy_controller_update(
    state: EntropyControllerState,
    current_entropy: Array | float,
    *,
    kind: EntropyControllerKind,
    target: float | None = None,
    delta: float | None = None,
    min_coef: float = 0.0,
    max_coef: float = 1.0,
) -> EntropyControllerState:
    """Dispatch on a static ``kind`` (config-driven trainers): ``fixed`` or ``adaptive``."""
    if kind == "fixed":
        return fixed_entropy_update(state, current_entropy)
    if kind == "adaptive":
        if target is None or delta is None:
            raise ValueError("the adaptive entropy controller needs target and delta")
        return adaptive_entropy_update(state, current_entropy, target=target, delta=delta, min_coef=min_coef,
                                       max_coef=max_coef)
    raise ValueError(f"unknown entropy controller {kind!r}; expected 'fixed' or 'adaptive'")
