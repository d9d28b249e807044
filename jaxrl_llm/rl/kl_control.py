"""KL-coefficient controllers as pure ``state -> state`` functions (Ziegler et al. 2019).

The state is a ``NamedTuple`` pytree holding the current coefficient as a float32 scalar array, so it
can live in a jitted train state, be checkpointed, and be read as a traced ``kl_coef`` by the losses.
"""

from typing import Literal, NamedTuple

import jax.numpy as jnp
from jax import Array

KLControllerKind = Literal["fixed", "adaptive"]


class KLControllerState(NamedTuple):
    """Current KL coefficient ``beta`` (float32 scalar)."""

    coef: Array


def init_kl_controller(init_coef: float | Array) -> KLControllerState:
    """Controller state starting at ``beta = init_coef``."""
    return KLControllerState(coef=jnp.asarray(init_coef, jnp.float32))


def fixed_kl_update(state: KLControllerState, current_kl: Array | float, n_steps: Array | int) -> KLControllerState:
    """Fixed controller: ``beta`` never changes. Same signature as ``adaptive_kl_update``."""
    del current_kl, n_steps
    return state


def adaptive_kl_update(
    state: KLControllerState,
    current_kl: Array | float,
    n_steps: Array | int,
    *,
    target: float,
    horizon: float,
) -> KLControllerState:
    """Adaptive controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences").

    ::

        e     = clip(KL / target - 1, -0.2, 0.2)          proportional error, clipped
        beta <- beta * (1 + e * n_steps / horizon)

    ``current_kl`` is the measured ``KL(pi || pi_ref)`` (per sequence, as in the paper, or per token:
    ``target`` must be in the same unit); ``n_steps`` the number of samples since the last update
    (the batch size in TRL / verl); ``horizon`` sets how fast ``beta`` moves (10000 in the paper).
    ``beta`` grows while KL is above target and shrinks while below. All scalars, float32.
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"target and horizon must be positive, got target={target}, horizon={horizon}")
    error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    factor = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon
    return KLControllerState(coef=state.coef * factor)


def kl_controller_update(
    state: KLControllerState,
    current_kl: Array | float,
    n_steps: Array | int,
    *,
    kind: KLControllerKind,
    target: float | None = None,
    horizon: float | None = None,
) -> KLControllerState:
    """Dispatch on a static ``kind`` (config-driven trainers): ``fixed`` or ``adaptive``."""
    if kind == "fixed":
        return fixed_kl_update(state, current_kl, n_steps)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target and horizon")
        return adaptive_kl_update(state, current_kl, n_steps, target=target, horizon=horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected 'fixed' or 'adaptive'")

