"""Tests for jaxrl_llm.rl.kl_control: fixed and adaptive (Ziegler et al. 2019) KL coefficients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rl import kl_control as kc

pytestmark = pytest.mark.quick

_ADAPTIVE = jax.jit(functools.partial(kc.adaptive_kl_update, target=6.0, horizon=10000.0))


def test_init_state_is_float32_scalar_pytree():
    state = kc.init_kl_controller(0.1)
    assert state.coef.dtype == jnp.float32 and state.coef.shape == ()
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 1


def test_fixed_controller_never_moves():
    state = kc.init_kl_controller(0.05)
    for kl in (0.0, 1.0, 100.0):
        assert float(kc.fixed_kl_update(state, kl, 256).coef) == np.float32(0.05)
    assert kc.kl_controller_update(state, 9.0, 256, kind="fixed") is state


def test_adaptive_controller_hand_computed():
    state = kc.init_kl_controller(0.1)
    # KL 9 vs target 6: error 9/6 - 1 = 0.5, clipped to 0.2; n/H = 256 / 10000 = 0.0256
    #   beta = 0.1 * (1 + 0.2 * 0.0256) = 0.1 * 1.00512 = 0.100512
    np.testing.assert_allclose(_ADAPTIVE(state, 9.0, 256).coef, 0.100512, rtol=1e-6)
    # KL 5.4: error 5.4/6 - 1 = -0.1 (inside the clip) -> beta = 0.1 * (1 - 0.1 * 0.0256) = 0.099744
    np.testing.assert_allclose(_ADAPTIVE(state, 5.4, 256).coef, 0.099744, rtol=1e-6)
    # KL 0: error -1 clipped to -0.2 -> 0.1 * (1 - 0.00512) = 0.099488
    np.testing.assert_allclose(_ADAPTIVE(state, 0.0, 256).coef, 0.099488, rtol=1e-6)
    # on target: unchanged
    np.testing.assert_allclose(_ADAPTIVE(state, 6.0, 256).coef, 0.1, rtol=1e-6)
    np.testing.assert_allclose(
        kc.kl_controller_update(state, 9.0, 256, kind="adaptive", target=6.0, horizon=10000.0).coef,
        0.100512,
        rtol=1e-6,
    )


@settings(max_examples=40, deadline=None)
@given(kl=st.floats(0.0, 100.0), coef=st.floats(1e-4, 1.0), n=st.integers(1, 4096))
def test_adaptive_moves_toward_target_within_clip(kl, coef, n):
    new = float(_ADAPTIVE(kc.init_kl_controller(coef), kl, n).coef)
    coef32 = float(np.float32(coef))
    step = 0.2 * n / 10000.0
    assert coef32 * (1 - step) * (1 - 1e-6) <= new <= coef32 * (1 + step) * (1 + 1e-6)
    if kl > 6.0 * 1.001:
        assert new > coef32
    elif kl < 6.0 * 0.999:
        assert new < coef32


def test_adaptive_errors_on_bad_config():
    state = kc.init_kl_controller(0.1)
    with pytest.raises(ValueError, match="positive"):
        kc.adaptive_kl_update(state, 1.0, 1, target=0.0, horizon=10.0)
    with pytest.raises(ValueError, match="target and horizon"):
        kc.kl_controller_update(state, 1.0, 1, kind="adaptive")
    with pytest.raises(ValueError, match="unknown KL controller"):
        kc.kl_controller_update(state, 1.0, 1, kind="pid")


def test_jit_scan_and_vmap():
    # as a carry of lax.scan over a sequence of measured KLs: KL above target twice, then below
    kls = jnp.array([12.0, 12.0, 3.0])

    def step(state, kl):
        new = kc.adaptive_kl_update(state, kl, 1000, target=6.0, horizon=10000.0)
        return new, new.coef

    final, coefs = jax.jit(lambda s: jax.lax.scan(step, s, kls))(kc.init_kl_controller(1.0))
    # errors clipped to +0.2, +0.2, -0.2 with n/H = 0.1: factors 1.02, 1.02, 0.98
    np.testing.assert_allclose(coefs, [1.02, 1.02 * 1.02, 1.02 * 1.02 * 0.98], rtol=1e-6)
    assert isinstance(final, kc.KLControllerState)

    # vmap over a batch of controllers (e.g. one per task) with their own KLs
    states = kc.KLControllerState(coef=jnp.array([0.1, 0.2, 0.3]))
    batched = jax.vmap(functools.partial(kc.adaptive_kl_update, n_steps=1000, target=6.0, horizon=10000.0))(
        states, jnp.array([12.0, 6.0, 0.0])
    )
    np.testing.assert_allclose(batched.coef, [0.1 * 1.02, 0.2, 0.3 * 0.98], rtol=1e-6)
    fixed = jax.jit(jax.vmap(kc.fixed_kl_update))(states, jnp.zeros(3), jnp.ones(3))
    np.testing.assert_array_equal(fixed.coef, states.coef)
