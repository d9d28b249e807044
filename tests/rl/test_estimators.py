"""The advantage dispatch: each estimator's values by hand on one small group-major rollout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.rl.estimators import kl_in_reward, rollout_advantages

pytestmark = pytest.mark.quick

# Two groups of two; rewards and masks written out so every expected value below is hand-computable.
REWARDS = jnp.array([1.0, 0.0, 3.0, 1.0])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
ZEROS = jnp.zeros((4, 3))


def test_grpo_broadcasts_group_normalised_advantages_over_valid_tokens():
    adv = rollout_advantages("grpo", REWARDS, MASK, ZEROS, ZEROS, group_size=2)
    # group (1, 0): mean 0.5, std (ddof 1) = sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711; group (3, 1): same
    a = 0.5 / np.sqrt(0.5)
    expected = np.array([[a, a, 0], [-a, 0, 0], [a, a, a], [-a, -a, 0]])
    np.testing.assert_allclose(adv, expected, rtol=1e-5)


def test_rloo_uses_the_leave_one_out_mean():
    adv = rollout_advantages("rloo", REWARDS, MASK, ZEROS, ZEROS, group_size=2)
    # with G = 2 the other sample is the baseline: 1 - 0 = 1, 0 - 1 = -1, 3 - 1 = 2, 1 - 3 = -2
    np.testing.assert_allclose(adv, [[1, 1, 0], [-1, 0, 0], [2, 2, 2], [-2, -2, 0]], rtol=1e-6)


def test_reinforce_pp_puts_kl_in_the_token_rewards():
    old = jnp.full((4, 3), -1.0)
    ref = jnp.full((4, 3), -1.5)  # k1 = old - ref = 0.5 on every valid token
    adv = rollout_advantages("reinforce_pp", REWARDS, MASK, old, ref, group_size=2, beta=0.1, kl_estimator="k1")
    # token rewards: -0.05 per token, + score at the last valid token; returns-to-go:
    returns = np.array([[0.9, 0.95, 0], [-0.05, 0, 0], [2.85, 2.9, 2.95], [0.9, 0.95, 0]])
    valid = np.asarray(MASK, bool)
    g = returns[valid]
    whitened = (returns - g.mean()) / np.sqrt(g.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(np.asarray(adv)[valid], whitened[valid], rtol=1e-4)
    assert np.all(np.asarray(adv)[~valid] == 0)
    assert kl_in_reward("reinforce_pp") and not kl_in_reward("grpo")


def test_reinforce_pp_baseline_centres_per_group_then_whitens_the_batch():
    adv = rollout_advantages("reinforce_pp_baseline", REWARDS, MASK, ZEROS, ZEROS, group_size=2)
    centred = np.array([[0.5, 0.5, 0], [-0.5, 0, 0], [1, 1, 1], [-1, -1, 0]])
    valid = np.asarray(MASK, bool)
    v = centred[valid]
    np.testing.assert_allclose(np.asarray(adv)[valid], ((centred - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8))[valid],
                               rtol=1e-4)


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="unknown advantage estimator .ppo.; expected one of grpo, rloo"):
        rollout_advantages("ppo", REWARDS, MASK, ZEROS, ZEROS, group_size=2)  # type: ignore[arg-type]


def sign_of_reward(rewards, mask, old_logp, ref_logp, *, group_size, scale="group", beta=0.0, kl_estimator="k1"):
    """An estimator from outside the package: +1 per token for a reward above the group's mean, else -1."""
    grouped = rewards.reshape(-1, group_size)
    above = (grouped > grouped.mean(axis=1, keepdims=True)).reshape(-1)
    return jnp.where(above, 1.0, -1.0)[:, None] * mask.astype(jnp.float32)


def test_an_estimator_registered_from_outside_is_a_config_choice():
    from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, register_estimator

    register_estimator("sign_of_reward_test")(sign_of_reward)
    try:
        adv = rollout_advantages("sign_of_reward_test", REWARDS, MASK, ZEROS, ZEROS, group_size=2)
        np.testing.assert_array_equal(adv, [[1, 1, 0], [-1, 0, 0], [1, 1, 1], [-1, -1, 0]])
        assert not kl_in_reward("sign_of_reward_test")
    finally:
        del ADVANTAGE_ESTIMATORS["sign_of_reward_test"]


def test_training_with_a_module_function_estimator(tiny_task, tmp_path):
    """`rl.estimator=module:function` imports, registers and trains with it: every advantage is +-1."""
    import train
    from tests.runs import read_rows, tiny_run_args

    out = tmp_path / "run"
    code = train.cli(tiny_run_args(out, "data.eval=", "steps=2", "rl.estimator=tests.rl.test_estimators:sign_of_reward",
                                   "rewards=[{name: 'tests.runs:starts_with_seven'}]", task=tiny_task))
    assert code == 0
    assert [r["advantages/abs_mean"] for r in read_rows(out)] == [1.0, 1.0]
    assert train.cli(["out_dir=" + str(tmp_path / "x"), "rl.estimator=nope"]) == 2
