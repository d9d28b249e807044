"""Tests for jaxrl_llm.rl.advantages: GRPO / Dr.GRPO, RLOO, REINFORCE++(-baseline), GAE, whitening."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rl import advantages as adv
from tests.numerics import assert_jit_vmap_agree

pytestmark = pytest.mark.quick

PROPS = settings(max_examples=40, deadline=None)
G = 4
# rewards on a 0.5 grid: a group's std is either 0 or >= ~0.25, so epsilon never matters in the properties
_REWARDS = hnp.arrays(np.float32, (3 * G,), elements=st.integers(-6, 6).map(lambda i: i / 2.0))
_GROUP_NORM = {
    s: jax.jit(functools.partial(adv.group_normalized_advantages, group_size=G, scale=s))
    for s in ("group", "batch", "none")
}
_RLOO = jax.jit(functools.partial(adv.rloo_advantages, group_size=G))


# ------------------------------------------------------------------------------------------------------
# group-normalised (GRPO / Dr.GRPO)
# ------------------------------------------------------------------------------------------------------


def test_group_normalized_hand_computed_pairs():
    # rewards [1, 0 | 0, 1], G = 2: mean 0.5, deviations +-0.5, unbiased std sqrt(0.5 / 1) = 0.70711
    out = adv.group_normalized_advantages(jnp.array([1.0, 0.0, 0.0, 1.0]), group_size=2)
    a = 0.5 / np.sqrt(0.5)  # 0.70711
    np.testing.assert_allclose(out, [a, -a, -a, a], rtol=1e-5)


def test_group_normalized_hand_computed_scales():
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25], sum of squares 0.5625 + 3 * 0.0625 = 0.75
    #   unbiased var 0.75 / 3 = 0.25 -> std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    # group 2: all equal -> deviations 0 -> advantages exactly 0 (epsilon keeps 0 / 0 away)
    np.testing.assert_allclose(
        adv.group_normalized_advantages(rewards, group_size=4),
        [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0],
        rtol=1e-5,
    )
    # biased std (ddof = 0): var 0.75 / 4 = 0.1875 -> 0.75 / sqrt(0.1875) = sqrt(3)
    s3 = np.sqrt(3.0)
    np.testing.assert_allclose(
        adv.group_normalized_advantages(rewards, group_size=4, ddof=0),
        [s3, -s3 / 3, -s3 / 3, -s3 / 3, 0, 0, 0, 0],
        rtol=1e-5,
    )
    # Dr.GRPO: no std division
    np.testing.assert_allclose(
        adv.group_normalized_advantages(rewards, group_size=4, scale="none"),
        [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0],
        rtol=1e-6,
    )
    # batch std of all 8 rewards: mean 9/8, deviations [-0.125, -1.125 x3, 0.875 x4],
    #   squared 0.015625 + 3 * 1.265625 + 4 * 0.765625 = 6.875; unbiased var 6.875 / 7 -> std 0.991031
    batch_std = np.sqrt(6.875 / 7.0)
    np.testing.assert_allclose(
        adv.group_normalized_advantages(rewards, group_size=4, scale="batch"),
        np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / batch_std,
        rtol=1e-5,
    )


def test_group_normalized_validates_static_config():
    with pytest.raises(ValueError, match="multiple of group_size"):
        adv.group_normalized_advantages(jnp.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="scale"):
        adv.group_normalized_advantages(jnp.zeros(4), group_size=2, scale="std")
    with pytest.raises(ValueError, match="ddof"):
        adv.group_normalized_advantages(jnp.zeros(4), group_size=1)


@PROPS
@given(rewards=_REWARDS, scale=st.sampled_from(["group", "batch", "none"]))
def test_group_advantages_have_zero_mean_per_group(rewards, scale):
    out = np.asarray(_GROUP_NORM[scale](rewards)).reshape(-1, G)
    np.testing.assert_allclose(out.mean(axis=1), 0.0, atol=1e-5)


@PROPS
@given(
    rewards=_REWARDS,
    shifts=hnp.arrays(np.float32, (3,), elements=st.integers(-10, 10).map(float)),
    scale=st.sampled_from(["group", "none"]),
)
def test_group_advantages_invariant_to_per_group_shift(rewards, shifts, scale):
    shifted = rewards + np.repeat(shifts, G)
    np.testing.assert_allclose(_GROUP_NORM[scale](shifted), _GROUP_NORM[scale](rewards), atol=1e-4)


@PROPS
@given(rewards=_REWARDS, shift=st.integers(-10, 10).map(float))
def test_batch_scaled_advantages_invariant_to_global_shift(rewards, shift):
    np.testing.assert_allclose(_GROUP_NORM["batch"](rewards + shift), _GROUP_NORM["batch"](rewards), atol=1e-4)


@PROPS
@given(rewards=_REWARDS, factor=st.floats(0.5, 20.0), scale=st.sampled_from(["group", "batch"]))
def test_std_normalized_advantages_invariant_to_scaling(rewards, factor, scale):
    np.testing.assert_allclose(
        _GROUP_NORM[scale](rewards * np.float32(factor)), _GROUP_NORM[scale](rewards), rtol=1e-4, atol=1e-4
    )


# ------------------------------------------------------------------------------------------------------
# RLOO
# ------------------------------------------------------------------------------------------------------


def test_rloo_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    # group 1: baselines (0+0+0)/3 = 0 for i=0, (1+0+0)/3 = 1/3 for the others
    # group 2 (sum 8): baselines (8-3)/3 = 5/3, (8-1)/3 = 7/3, (8-2)/3 = 2, 2
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 3 - 5 / 3, 1 - 7 / 3, 0.0, 0.0]
    np.testing.assert_allclose(adv.rloo_advantages(rewards, group_size=4), expected, rtol=1e-5, atol=1e-6)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="group_size >= 2"):
        adv.rloo_advantages(jnp.zeros(3), group_size=1)


@PROPS
@given(rewards=_REWARDS, index=st.integers(0, 3 * G - 1), delta=st.floats(-5.0, 5.0))
def test_rloo_baseline_excludes_the_sample_itself(rewards, index, delta):
    bumped = rewards.copy()
    bumped[index] += np.float32(delta)
    baseline = rewards - np.asarray(_RLOO(rewards))
    baseline_bumped = bumped - np.asarray(_RLOO(bumped))
    # the sample's own baseline does not move ...
    np.testing.assert_allclose(baseline_bumped[index], baseline[index], atol=1e-4)
    # ... the other members of its group see a shift of delta / (G - 1), other groups nothing
    group = index // G
    expected = baseline.copy()
    for j in range(group * G, (group + 1) * G):
        if j != index:
            expected[j] += (bumped[index] - rewards[index]) / (G - 1)
    np.testing.assert_allclose(baseline_bumped, expected, atol=1e-4)


# ------------------------------------------------------------------------------------------------------
# returns, REINFORCE++, whitening
# ------------------------------------------------------------------------------------------------------


def test_discounted_returns_hand_computed_with_mask_hole():
    rewards = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    mask = jnp.array([[1, 0, 1, 1]])
    # t=3: 4; t=2: 3 + 0.5 * 4 = 5; t=1 masked: 0 (the 2 is not produced by the policy);
    # t=0: 1 + 0.5 * 5 = 3.5 (the hole consumes no discount step)
    np.testing.assert_allclose(adv.discounted_returns(rewards, mask, gamma=0.5), [[3.5, 0.0, 5.0, 4.0]])


def test_masked_whiten_hand_computed():
    x = jnp.array([[1.0, 2.0, 99.0], [3.0, 99.0, 99.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    # valid 1, 2, 3: mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    np.testing.assert_allclose(adv.masked_whiten(x, mask, epsilon=0.0), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(
        adv.masked_whiten(x, mask, shift_mean=False, epsilon=0.0), [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], atol=1e-6
    )


def test_reinforce_plus_plus_hand_computed():
    token_rewards = jnp.array([[0.0, 0.0, 1.0], [-0.1, 0.5, 7.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    # gamma 1 returns: row 0 [1, 1, 1]; row 1 [-0.1 + 0.5, 0.5] = [0.4, 0.5] (the masked 7 is ignored)
    # mean (1 + 1 + 1 + 0.4 + 0.5) / 5 = 0.78
    # squared deviations 3 * 0.22^2 + 0.38^2 + 0.28^2 = 0.1452 + 0.1444 + 0.0784 = 0.368; unbiased var 0.092
    std = np.sqrt(0.092)
    expected = [[0.22 / std, 0.22 / std, 0.22 / std], [-0.38 / std, -0.28 / std, 0.0]]
    out = adv.reinforce_plus_plus_advantages(token_rewards, mask, gamma=1.0, epsilon=0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_baseline_hand_computed():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0])
    mask = jnp.array([[1, 1], [1, 0], [1, 1], [1, 1]])
    # group means 0.5 and 1 -> centered [0.5, -0.5, 0, 0]; valid tokens 0.5, 0.5, -0.5, 0, 0, 0, 0
    # mean 0.5 / 7 = 1/14; squared deviations 2 * (3/7)^2 + (4/7)^2 + 4 * (1/14)^2 = 5/7; unbiased var 5/42
    std = np.sqrt(5.0 / 42.0)
    a, b, c = (0.5 - 1 / 14) / std, (-0.5 - 1 / 14) / std, (0 - 1 / 14) / std
    expected = [[a, a], [b, 0.0], [c, c], [c, c]]
    out = adv.reinforce_plus_plus_baseline_advantages(rewards, mask, group_size=2, epsilon=0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    rewards = jnp.array([[0.0, 0.0, 1.0]])
    values = jnp.array([[0.5, 0.6, 0.7]])
    mask = jnp.ones((1, 3))
    # gamma 1, lam 0.5: deltas t2: 1 - 0.7 = 0.3; t1: 0.7 - 0.6 = 0.1; t0: 0.6 - 0.5 = 0.1
    #   A2 = 0.3; A1 = 0.1 + 0.5 * 0.3 = 0.25; A0 = 0.1 + 0.5 * 0.25 = 0.225; R = A + V
    a, r = adv.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    np.testing.assert_allclose(a, [[0.225, 0.25, 0.3]], rtol=1e-5)
    np.testing.assert_allclose(r, [[0.725, 0.85, 1.0]], rtol=1e-5)
    # gamma 0.9, lam 1: A0 = 0.9^2 * 1 - 0.5 = 0.31; A1 = 0.9 - 0.6 = 0.3; A2 = 1 - 0.7 = 0.3
    a, _ = adv.gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    np.testing.assert_allclose(a, [[0.31, 0.3, 0.3]], rtol=1e-5)


def test_gae_respects_padding_and_mask_holes():
    # right padding: garbage reward / value at t=2 must not be bootstrapped
    a, r = adv.gae_advantages(
        jnp.array([[0.0, 1.0, 999.0]]), jnp.array([[0.5, 0.6, 123.0]]), jnp.array([[1, 1, 0]]), gamma=1.0, lam=1.0
    )
    # A1 = 1 - 0.6 = 0.4; A0 = 0 + 0.6 - 0.5 + 0.4 = 0.5
    np.testing.assert_allclose(a, [[0.5, 0.4, 0.0]], rtol=1e-5)
    np.testing.assert_allclose(r, [[1.0, 1.0, 0.0]], rtol=1e-5)
    # hole at t=1: t=0 bootstraps from V_2 and takes one discount step
    a, _ = adv.gae_advantages(
        jnp.array([[0.0, 7.0, 1.0]]), jnp.array([[0.5, 9.0, 0.7]]), jnp.array([[1, 0, 1]]), gamma=0.9, lam=1.0
    )
    # A2 = 1 - 0.7 = 0.3; A0 = 0 + 0.9 * 0.7 - 0.5 + 0.9 * 0.3 = 0.13 + 0.27 = 0.4
    np.testing.assert_allclose(a, [[0.4, 0.0, 0.3]], rtol=1e-5, atol=1e-6)


_GAE_11 = jax.jit(functools.partial(adv.gae_advantages, gamma=1.0, lam=1.0))


@PROPS
@given(
    rewards=hnp.arrays(np.float32, (3, 6), elements=st.floats(-3, 3, width=32)),
    values=hnp.arrays(np.float32, (3, 6), elements=st.floats(-3, 3, width=32)),
    lengths=hnp.arrays(np.int32, (3,), elements=st.integers(0, 6)),
)
def test_gae_lambda1_gamma1_is_return_to_go_minus_value(rewards, values, lengths):
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.int32)
    r = np.where(mask > 0, rewards, 0.0)
    return_to_go = np.cumsum(r[:, ::-1], axis=1)[:, ::-1]
    expected = np.where(mask > 0, return_to_go - values, 0.0)
    a, ret = _GAE_11(rewards, values, mask)
    np.testing.assert_allclose(a, expected, atol=1e-4)
    np.testing.assert_allclose(ret, np.where(mask > 0, return_to_go, 0.0), atol=1e-4)


# ------------------------------------------------------------------------------------------------------
# jit / vmap
# ------------------------------------------------------------------------------------------------------

_R = jnp.array([1.0, 0.0, 0.5, 0.25, 2.0, 1.0, 0.0, 3.0])
_TR = jax.random.normal(jax.random.key(0), (4, 5))
_V = jax.random.normal(jax.random.key(1), (4, 5))
_M = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        *[
            (functools.partial(adv.group_normalized_advantages, group_size=4, scale=s), (_R,))
            for s in ("group", "batch", "none")
        ],
        (functools.partial(adv.rloo_advantages, group_size=4), (_R,)),
        (adv.masked_whiten, (_TR, _M)),
        (functools.partial(adv.discounted_returns, gamma=0.9), (_TR, _M)),
        (adv.reinforce_plus_plus_advantages, (_TR, _M)),
        (functools.partial(adv.reinforce_plus_plus_baseline_advantages, group_size=2), (_R[:4], _M)),
        (functools.partial(adv.gae_advantages, gamma=0.99, lam=0.95), (_TR, _V, _M)),
    ],
)
def test_jit_and_vmap(fn, args):
    assert_jit_vmap_agree(fn, *args)


def test_gae_traced_gamma_lambda():
    # gamma / lam may come from a traced config (e.g. a schedule); no recompilation or Python branching
    f = jax.jit(adv.gae_advantages)
    a1, _ = f(_TR, _V, _M, gamma=jnp.float32(1.0), lam=jnp.float32(1.0))
    a2, _ = f(_TR, _V, _M, gamma=jnp.float32(0.5), lam=jnp.float32(0.5))
    assert not np.allclose(a1, a2)
    np.testing.assert_allclose(a1, adv.gae_advantages(_TR, _V, _M, gamma=1.0, lam=1.0)[0], atol=1e-6)
