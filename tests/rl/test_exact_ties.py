"""Exact where the math is exact: a group whose rewards are all equal gets advantage 0.0, jitted or not.

The float32 mean of equal values is off by a rounding step for most values and group sizes (eight rewards of 0.7
averaged to 0.7 + 6e-8), and dividing by ``std + 1e-6`` (the std itself a rounding step) once turned that into
|A| = 0.056. Every estimator that centres within a group is checked here against that, and against a float64
reference for the groups that are not tied; the value-clip fraction against a float64 count.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rl import advantages as adv
from jaxrl_llm.rl.reductions import masked_var
from jaxrl_llm.rl.value_loss import clipped_value_loss
from jaxrl_llm.trainers.rollouts import tied_groups

pytestmark = pytest.mark.quick

PROPS = settings(max_examples=60, deadline=None)
EPS = 1e-6


@st.composite
def reward_batches(draw: st.DrawFn) -> tuple[np.ndarray, int, str]:
    """``(rewards [P * G] float32, G, kind)``: binary rewards, a few repeated floats, or a continuous range with
    one group tied at a value drawn from the range. Shapes come from a few sizes (odd and even, one group to four):
    each new shape is a compile, the values are what the properties are about."""
    group_size = draw(st.sampled_from([2, 3, 5, 8, 16]))
    prompts = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["binary", "repeated", "continuous"]))
    n = prompts * group_size
    if kind == "binary":
        values = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    elif kind == "repeated":
        values = draw(st.lists(st.sampled_from([0.7, 3.0, -1.5]), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.floats(-5.0, 5.0, width=32), min_size=n, max_size=n))
        tied = draw(st.integers(0, prompts - 1))
        value = draw(st.floats(-5.0, 5.0, width=32))
        values[tied * group_size:(tied + 1) * group_size] = [value] * group_size
    # Some batches tie every group the same way (all correct, all wrong): the batch std is then 0 too.
    if draw(st.booleans()) and kind != "continuous":
        values = [values[0]] * n
    return np.asarray(values, np.float32), group_size, kind


def _reference_group_normalized(rewards: np.ndarray, group_size: int, scale: str) -> np.ndarray:
    """The formula in float64: ``(r - mean_group r) / (std + eps)``, ``std`` of the group, the batch or 1."""
    r = rewards.astype(np.float64).reshape(-1, group_size)
    centered = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + EPS)
    elif scale == "batch":
        centered = centered / (r.std(ddof=1) + EPS)
    return centered.reshape(-1)


def _tied_rows(rewards: np.ndarray, group_size: int) -> np.ndarray:
    return np.repeat(tied_groups(rewards, group_size), group_size)


def _check(out: jax.Array, reference: np.ndarray, tied: np.ndarray, scale_of_values: float) -> None:
    out = np.asarray(out)
    assert out.dtype == np.float32
    assert np.all(out[tied] == 0.0), f"tied groups got {out[tied]}"
    # float32 rounding of rewards up to 5 and of the division by a std no smaller than the draws make it.
    np.testing.assert_allclose(out[~tied], reference[~tied], rtol=2e-4, atol=2e-5 * scale_of_values)


@functools.cache
def _jitted(fn, items):  # noqa: ANN001, ANN202 - one jitted function per setting, reused across examples
    return jax.jit(functools.partial(fn, **dict(items)))


def _functions(fn, **kwargs):  # noqa: ANN001, ANN202 - both ways a user calls it
    return functools.partial(fn, **kwargs), _jitted(fn, tuple(sorted(kwargs.items())))


@PROPS
@given(batch=reward_batches(), scale=st.sampled_from(["group", "batch", "none"]), bf16=st.booleans())
def test_group_normalized_advantages_are_exactly_zero_for_tied_groups(batch: tuple[np.ndarray, int, str], scale: str,
                                                                     bf16: bool) -> None:
    rewards, group_size, _ = batch
    if bf16:  # rewards that arrive in bfloat16 (a reward model's score): the same values, rounded
        rewards = np.asarray(jnp.asarray(rewards, jnp.bfloat16).astype(jnp.float32))
    tied = _tied_rows(rewards, group_size)
    reference = _reference_group_normalized(rewards, group_size, scale)
    inputs = jnp.asarray(rewards, jnp.bfloat16) if bf16 else jnp.asarray(rewards)
    for fn in _functions(adv.group_normalized_advantages, group_size=group_size, scale=scale):
        # A near-tied group (two continuous draws a few ulps apart) divided by a std of ~1e-7 is ill-conditioned in
        # any precision; its float32 result is checked to keep its sign pattern, the others against float64.
        r64 = rewards.astype(np.float64).reshape(-1, group_size)
        spread = np.repeat(r64.std(axis=1, ddof=1), group_size)
        well_posed = (spread > 1e-3) | tied | (scale != "group")
        out = np.asarray(fn(inputs))
        assert np.all(out[tied] == 0.0), f"{scale}: tied groups got {out[tied]}"
        _check(out[well_posed], reference[well_posed], tied[well_posed], 1.0 if scale != "none" else 5.0)
        assert np.all(np.sign(out[~well_posed]) == np.sign(reference[~well_posed]))


@PROPS
@given(batch=reward_batches())
def test_rloo_advantages_are_exactly_zero_for_tied_groups(batch: tuple[np.ndarray, int, str]) -> None:
    rewards, group_size, _ = batch
    r = rewards.astype(np.float64).reshape(-1, group_size)
    reference = (r - (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)).reshape(-1)
    for fn in _functions(adv.rloo_advantages, group_size=group_size):
        _check(fn(jnp.asarray(rewards)), reference, _tied_rows(rewards, group_size), 10.0)


@PROPS
@given(batch=reward_batches(), length=st.sampled_from([1, 3, 6]), data=st.data())
def test_reinforce_pp_baseline_centres_tied_groups_exactly(batch: tuple[np.ndarray, int, str], length: int,
                                                           data: st.DataObject) -> None:
    """A tied group's centred score is exactly 0, so every token of every tied group gets one and the same value,
    ``-mean(a) / sqrt(var(a) + 1e-8)`` (batch whitening, as verl); all of it against float64."""
    rewards, group_size, _ = batch
    n = rewards.size
    lengths = np.asarray(data.draw(st.lists(st.integers(1, length), min_size=n, max_size=n)))
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    r = rewards.astype(np.float64).reshape(-1, group_size)
    a = np.repeat((r - r.mean(axis=1, keepdims=True)).reshape(-1)[:, None], length, axis=1)
    valid = mask > 0
    mean, var = a[valid].mean(), (a[valid].var(ddof=1) if valid.sum() > 1 else 0.0)
    reference = np.where(valid, (a - mean) / np.sqrt(var + 1e-8), 0.0)
    tied = _tied_rows(rewards, group_size)
    for fn in _functions(adv.reinforce_plus_plus_baseline_advantages, group_size=group_size):
        out = np.asarray(fn(jnp.asarray(rewards), jnp.asarray(mask)))
        tied_tokens = out[tied][valid[tied]]
        assert tied_tokens.size == 0 or np.all(tied_tokens == tied_tokens[0])
        if np.all(tied):  # every centred score is 0: the whitened batch is exactly 0 too
            assert np.all(out == 0.0)
        np.testing.assert_allclose(out, reference, rtol=2e-4, atol=2e-4)


@PROPS
@given(value=st.floats(-1e3, 1e3, width=32, allow_subnormal=False), rows=st.integers(1, 8), length=st.integers(1, 9),
       shift_mean=st.booleans())
def test_whitening_equal_values_gives_zero(value: float, rows: int, length: int, shift_mean: bool) -> None:
    """Token-level whitening (PPO's GAE, REINFORCE++) of equal values: 0 (or the value back, without the shift);
    the masked variance of equal values is exactly 0, whatever the padding holds. (Subnormal values are left out:
    XLA:CPU flushes them to zero.)"""
    # One shape for every example (one compile, jitted or not): `rows x length` real tokens, the rest padding that
    # holds another value and must not enter any statistic.
    x = np.full((8, 11), np.float32(7.25), np.float32)
    x[:rows, :length] = value
    mask = np.zeros_like(x)
    mask[:rows, :length] = 1
    real = mask > 0
    for fn in _functions(adv.masked_whiten, shift_mean=shift_mean):
        out = np.asarray(fn(jnp.asarray(x), jnp.asarray(mask)))
        assert np.all(out[real] == (np.float32(value) if not shift_mean else 0.0))
        assert np.all(out[~real] == 0.0)
    assert float(masked_var(jnp.asarray(x), jnp.asarray(mask), ddof=1)) == 0.0
    assert float(jax.jit(masked_var)(jnp.asarray(x), jnp.asarray(mask))) == 0.0


@PROPS
@given(batch=reward_batches(), scale=st.sampled_from(["group", "batch"]))
def test_turn_credit_of_a_tied_group_is_not_divided_by_a_rounding_step(batch: tuple[np.ndarray, int, str],
                                                                        scale: str) -> None:
    """Multi-turn credit ``(G_k - G_1) / (std + eps)``: a tied group (std 0) keeps its credit undivided."""
    rewards, group_size, _ = batch
    n = rewards.size
    credit = np.tile(np.array([[0.0, -0.5, -1.0]], np.float32), (n, 1))
    outcome = np.zeros((n, 3), np.float32)
    r = rewards.astype(np.float64)
    std = (np.repeat(r.reshape(-1, group_size).std(axis=1, ddof=1), group_size) if scale == "group"
           else np.full(n, r.std(ddof=1)))
    tied = _tied_rows(rewards, group_size) if scale == "group" else np.full(n, np.ptp(rewards) == 0)
    for fn in _functions(adv.turn_level_advantages, group_size=group_size, scale=scale):
        out = np.asarray(fn(jnp.asarray(outcome), jnp.asarray(credit), jnp.asarray(rewards)))
        np.testing.assert_array_equal(out[tied], credit[tied])
        expected = credit / (std + EPS)[:, None]
        well_posed = ~tied & (std > 1e-3)
        np.testing.assert_allclose(out[well_posed], expected[well_posed], rtol=2e-4)


def test_the_reported_cases_give_zero() -> None:
    """The issue's cases: three prompts with an all-correct group at group sizes 3 and 5 (jitted, as the trainer
    runs it), and a group of eight rewards of 0.7 called directly (|A| was 0.056)."""
    for group_size in (3, 5, 6, 8, 12):
        rewards = np.zeros((3, group_size), np.float32)
        rewards[0] = 1.0
        rewards[1, :2] = 1.0
        fn = jax.jit(functools.partial(adv.group_normalized_advantages, group_size=group_size))
        out = np.asarray(fn(jnp.asarray(rewards.reshape(-1)))).reshape(3, group_size)
        assert np.all(out[0] == 0.0) and np.all(out[2] == 0.0)
        assert out[1, 0] > 0 > out[1, -1]
    assert np.all(np.asarray(adv.group_normalized_advantages(jnp.full(8, 0.7), group_size=8)) == 0.0)


def test_tied_groups_and_the_reward_std_metric_see_equal_rewards_as_equal() -> None:
    """The rollout's `frac_zero_std_groups` and dynamic sampling's filter: numpy's float32 std of seven 0.7s is not 0
    (what the filter used to test), and seven 0.7s are one tied group."""
    rewards = np.array([0.7] * 7 + [0.7] * 6 + [0.0], np.float32)
    assert float(rewards[:7].std()) > 0.0
    np.testing.assert_array_equal(tied_groups(rewards, 7), [True, False])


@PROPS
@given(seed=st.integers(0, 2**31 - 1), clip_range=st.sampled_from([0.25, 0.5, 0.125]))
def test_value_clip_fraction_equals_a_float64_count(seed: int, clip_range: float) -> None:
    """V inside the clip range (never counted), exactly on its edge (never counted: the clipped value is V) and
    outside it (counted where the clipped term is the larger), against the same count in float64."""
    rng = np.random.default_rng(seed)
    shape = (6, 40)
    # Dyadic old values so that `V_old +- e` is exact for e = 0.25 and 0.5 and "on the edge" means on it.
    v_old = (rng.integers(-64, 64, shape) / 8.0).astype(np.float32)
    where = rng.integers(0, 3, shape)  # 0 inside, 1 on the edge, 2 outside
    sign = rng.choice([-1.0, 1.0], shape)
    offset = np.select([where == 0, where == 1, where == 2],
                       [rng.uniform(-0.9, 0.9, shape) * clip_range, sign * clip_range,
                        sign * clip_range * rng.uniform(1.1, 4.0, shape)])
    values = (v_old.astype(np.float64) + offset).astype(np.float32)
    returns = rng.normal(0.0, 2.0, shape).astype(np.float32)
    mask = (rng.random(shape) < 0.85).astype(np.float32)

    v, vo, ret = (a.astype(np.float64) for a in (values, v_old, returns))
    e = float(np.float32(clip_range))
    v_clip = np.clip(v, vo - e, vo + e)
    counted = (v_clip - ret) ** 2 > (v - ret) ** 2
    expected = counted[mask > 0].mean()
    for fn in _functions(clipped_value_loss, clip_range=clip_range):
        _, metrics = fn(jnp.asarray(values), jnp.asarray(v_old), jnp.asarray(returns), jnp.asarray(mask))
        assert float(metrics["value_clip_fraction"]) == np.float32(expected)
    # Inside the range or on its edge nothing is ever counted, whatever the returns.
    inside = (where < 2) & (mask > 0)
    _, metrics = clipped_value_loss(jnp.asarray(values), jnp.asarray(v_old), jnp.asarray(returns),
                                    jnp.asarray(inside.astype(np.float32)), clip_range=clip_range)
    assert float(metrics["value_clip_fraction"]) == 0.0
