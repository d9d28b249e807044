"""Tests for the losses of jaxrl_llm.rl (kl, surrogates, policy_loss, value_loss, preference): KL estimators,
reward shaping, clipped policy loss, value loss, DPO."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jaxrl_llm.rl as L
import jaxrl_llm.rl as lp
from jaxrl_llm.rl.rollout_correction import ROLLOUT_CORRECTION_MODES
from tests.batches import with_options
from tests.numerics import assert_jit_vmap_agree

pytestmark = pytest.mark.quick

PROPS = settings(max_examples=40, deadline=None)
LN2 = np.log(2.0)


# ------------------------------------------------------------------------------------------------------
# KL estimators
# ------------------------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    logp = jnp.log(jnp.array([0.5, 0.25]))
    ref_logp = jnp.log(jnp.array([0.25, 0.5]))
    # token 0: d = ref - logp = -ln2; token 1: d = +ln2
    # k1 = -d = [ln2, -ln2]; k2 = d^2 / 2 = (ln2)^2 / 2 = 0.240227
    # k3 = e^d - d - 1: [0.5 + ln2 - 1, 2 - ln2 - 1] = [0.193147, 0.306853]
    np.testing.assert_allclose(L.kl_penalty(logp, ref_logp, estimator="k1"), [LN2, -LN2], rtol=1e-6)
    np.testing.assert_allclose(L.kl_penalty(logp, ref_logp, estimator="k2"), [LN2**2 / 2] * 2, rtol=1e-6)
    np.testing.assert_allclose(L.kl_penalty(logp, ref_logp, estimator="k3"), [LN2 - 0.5, 1.0 - LN2], rtol=1e-5)
    np.testing.assert_allclose(L.kl_penalty(logp, ref_logp, estimator="k1", clamp=0.5), [0.5, -0.5], rtol=1e-6)
    with pytest.raises(ValueError, match="KL estimator"):
        L.kl_penalty(logp, ref_logp, estimator="k4")


_KL = {e: jax.jit(functools.partial(L.kl_penalty, estimator=e)) for e in ("k1", "k2", "k3")}
_LOGP = hnp.arrays(np.float32, (2, 6), elements=st.floats(-12, 0, width=32))


@PROPS
@given(logp=_LOGP, ref_logp=_LOGP)
def test_k2_k3_nonnegative(logp, ref_logp):
    assert (np.asarray(_KL["k2"](logp, ref_logp)) >= 0).all()
    assert (np.asarray(_KL["k3"](logp, ref_logp)) >= 0).all()


def test_k3_keeps_its_digits_for_tiny_log_ratios():
    """k3 = e^d - d - 1 against float64 for |d| from 1e-7 to 5 (float32's e^d - d - 1 gave -6e-8 at d = 6e-8)."""
    d = np.array([6e-8, -6e-8, 1e-5, -3e-4, 9.9e-3, -1.01e-2, 0.099, -0.101, 0.5, -2.0, 5.0], np.float32)
    got = np.asarray(_KL["k3"](np.zeros_like(d)[None], d[None]))[0]
    d64 = d.astype(np.float64)
    np.testing.assert_allclose(got, np.expm1(d64) - d64, rtol=2e-6)


@PROPS
@given(logp=_LOGP, estimator=st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_zero_when_p_equals_q(logp, estimator):
    np.testing.assert_array_equal(_KL[estimator](logp, logp), 0.0)


def test_kl_penalty_mask_neutralises_padding_values_and_gradients():
    logp = jnp.array([[-1.0, jnp.nan, 1e4]])
    ref_logp = jnp.array([[-1.5, -2.0, -1e4]])
    mask = jnp.array([[1, 0, 0]])
    out = L.kl_penalty(logp, ref_logp, estimator="k3", mask=mask)
    # valid token: d = -0.5 -> e^-0.5 + 0.5 - 1 = 0.106531
    np.testing.assert_allclose(out, [[np.exp(-0.5) - 0.5, 0.0, 0.0]], rtol=1e-5)
    grad = jax.grad(lambda x: L.kl_penalty(x, ref_logp, estimator="k3", mask=mask).sum())(logp)
    # d k3 / d logp = -(e^d - 1) = 1 - e^-0.5 at the valid token, exactly 0 elsewhere
    np.testing.assert_allclose(grad, [[1 - np.exp(-0.5), 0.0, 0.0]], rtol=1e-5)


def test_last_token_mask_and_kl_shaped_rewards_hand_computed():
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(L.last_token_mask(mask), [[0, 0, 1], [0, 1, 0], [0, 0, 0]])
    ref_logp = jnp.zeros((3, 3))
    logp = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [1.0, 1.0, 1.0]])  # k1 = logp - ref = logp
    scores = jnp.array([1.0, 2.0, 5.0])
    out = L.kl_shaped_token_rewards(scores, logp, ref_logp, mask, kl_coef=0.5)
    # r_t = -0.5 * k1_t, plus the score on the last valid token; padding 0; an empty row gets nothing
    expected = [[-0.05, -0.1, -0.15 + 1.0], [-0.2, -0.25 + 2.0, 0.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


# ------------------------------------------------------------------------------------------------------
# clipped surrogate
# ------------------------------------------------------------------------------------------------------


def test_clipped_surrogate_hand_computed():
    ratio = jnp.array([0.5, 1.0, 1.5, 0.5, 1.5, 3.0])
    a = jnp.array([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    # -min(r A, clip(r, 0.8, 1.2) A):
    #   A=+1: r=0.5 -> -min(0.5, 0.8) = -0.5; r=1 -> -1; r=1.5 -> -min(1.5, 1.2) = -1.2
    #   A=-1: r=0.5 -> -min(-0.5, -0.8) = 0.8; r=1.5 -> -min(-1.5, -1.2) = 1.5; r=3 -> 3
    np.testing.assert_allclose(L.clipped_surrogate(ratio, a), [-0.5, -1.0, -1.2, 0.8, 1.5, 3.0], rtol=1e-6)
    # clip-higher: epsilon_high = 0.28 -> r=1.5, A=+1 gives -1.28
    np.testing.assert_allclose(L.clipped_surrogate(ratio, a, epsilon_high=0.28)[2], -1.28, rtol=1e-6)
    # dual clip c = 2 bounds the A<0 losses by -c A = 2: r=3 -> min(3, 2) = 2; A>0 tokens untouched
    np.testing.assert_allclose(
        L.clipped_surrogate(ratio, a, dual_clip_c=2.0), [-0.5, -1.0, -1.2, 0.8, 1.5, 2.0], rtol=1e-6
    )
    with pytest.raises(ValueError, match="dual_clip_c"):
        L.clipped_surrogate(ratio, a, dual_clip_c=1.0)


# ------------------------------------------------------------------------------------------------------
# composed policy loss: hand-computed case
# ------------------------------------------------------------------------------------------------------

OLD = jnp.full((2, 3), np.log(0.5)).at[1, 2].set(-50.0)
RATIOS = jnp.array([[1.0, 1.5, 0.5], [0.7, 1.1, 1.0]])
LOGP = (OLD + jnp.log(RATIOS)).at[1, 2].set(50.0)  # garbage at the padded position: log-ratio 100
ADV = jnp.array([1.0, -1.0])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
# per-token surrogate, eps 0.2:  row 0 (A=+1): r=1 -> -1, r=1.5 -> -1.2 (clipped high), r=0.5 -> -0.5
#                                row 1 (A=-1): r=0.7 -> -min(-0.7, -0.8) = 0.8 (clipped low), r=1.1 -> 1.1
SURR_SUM_ROW0, SURR_SUM_ROW1 = -2.7, 1.9


def test_policy_loss_hand_computed_token_mean_and_metrics():
    loss, m = L.clipped_policy_loss(LOGP, OLD, ADV, MASK)
    np.testing.assert_allclose(loss, (SURR_SUM_ROW0 + SURR_SUM_ROW1) / 5, rtol=1e-5)  # -0.16
    np.testing.assert_allclose(m["policy_loss"], -0.16, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction/high"], 1 / 5)  # r=1.5 with A>0
    np.testing.assert_allclose(m["clip_fraction/low"], 1 / 5)  # r=0.7 with A<0
    np.testing.assert_allclose(m["clip_fraction"], 2 / 5)
    np.testing.assert_allclose(m["clip_fraction/dual"], 0.0)
    np.testing.assert_allclose(m["ratio/mean"], (1 + 1.5 + 0.5 + 0.7 + 1.1) / 5, rtol=1e-5)  # 0.96
    np.testing.assert_allclose(m["ratio/min"], 0.5, rtol=1e-5)  # the padded ratio e^20 is ignored
    np.testing.assert_allclose(m["ratio/max"], 1.5, rtol=1e-5)
    # approx_kl = mean(r - 1 - ln r): 0 + (0.5 - 0.405465) + (-0.5 + 0.693147) + (-0.3 + 0.356675) + (0.1 - 0.09531)
    approx = (0.0 + (0.5 - np.log(1.5)) + (-0.5 - np.log(0.5)) + (-0.3 - np.log(0.7)) + (0.1 - np.log(1.1))) / 5
    np.testing.assert_allclose(m["approx_kl"], approx, rtol=1e-4)  # 0.0698094
    assert all(v.dtype == jnp.float32 and v.shape == () for v in m.values())
    assert "kl" not in m and "entropy" not in m


def test_policy_loss_hand_computed_gradient():
    grad = jax.grad(lambda x: L.clipped_policy_loss(x, OLD, ADV, MASK)[0])(LOGP)
    # token-mean over N = 5: unclipped tokens d(-r A)/d logp / N = -r A / 5; clipped tokens 0; padding 0
    # row 0: r=1 -> -0.2; r=1.5 clipped -> 0; r=0.5 (A>0, below the range: not clipped) -> -0.1
    # row 1: r=0.7 clipped -> 0; r=1.1 (A<0, above the range: not clipped) -> +0.22
    np.testing.assert_allclose(grad, [[-0.2, 0.0, -0.1], [0.0, 0.22, 0.0]], rtol=1e-5, atol=1e-7)


def test_policy_loss_seq_mean_token_mean_and_token_level_advantages():
    loss, _ = L.clipped_policy_loss(
        LOGP, OLD, ADV, MASK, options=L.PolicyLossOptions(aggregation="seq-mean-token-mean")
    )
    np.testing.assert_allclose(loss, (SURR_SUM_ROW0 / 3 + SURR_SUM_ROW1 / 2) / 2, rtol=1e-5)  # 0.025
    # a [B, T] advantage equal to the broadcast [B] one gives the same loss
    loss_bt, _ = L.clipped_policy_loss(LOGP, OLD, jnp.broadcast_to(ADV[:, None], (2, 3)), MASK)
    np.testing.assert_allclose(loss_bt, -0.16, rtol=1e-5)


def test_policy_loss_kl_entropy_and_truncated_is_terms():
    ref_logp = LOGP - 0.1  # k1 = logp - ref = 0.1 on every valid token
    entropy = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])  # valid mean (1+2+3+4+5)/5 = 3
    loss, m = L.clipped_policy_loss(
        LOGP,
        OLD,
        ADV,
        MASK,
        ref_logp=ref_logp,
        kl_coef=0.5,
        entropy=entropy,
        entropy_coef=0.01,
        options=L.PolicyLossOptions(kl_estimator="k1"),
    )
    # -0.16 + 0.5 * 0.1 - 0.01 * 3 = -0.14
    np.testing.assert_allclose(loss, -0.16 + 0.05 - 0.03, rtol=1e-5)
    np.testing.assert_allclose(m["kl"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["policy_loss"], -0.16, rtol=1e-5)
    # k3 of d = -0.1: e^-0.1 + 0.1 - 1 = 0.0048374
    _, m3 = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, ref_logp=ref_logp, kl_coef=0.5)
    np.testing.assert_allclose(m3["kl"], np.exp(-0.1) + 0.1 - 1, rtol=1e-4)

    # TIS: sampler probability 1/3 of the trainer's on row 0 -> w = 3, capped at 2; row 1 w = 1
    sampler = OLD.at[0].add(-np.log(3.0))
    capped = L.PolicyLossOptions(rollout_correction="token_truncate", rollout_correction_cap=2.0)
    loss_tis, m_tis = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, sampler_logp=sampler, options=capped)
    np.testing.assert_allclose(loss_tis, (2 * SURR_SUM_ROW0 + SURR_SUM_ROW1) / 5, rtol=1e-5)  # -0.7
    np.testing.assert_allclose(m_tis["is_weight/mean"], (2 + 2 + 2 + 1 + 1) / 5, rtol=1e-5)
    uncapped = L.PolicyLossOptions(rollout_correction="token_truncate", rollout_correction_cap=1e6)
    loss_untruncated, _ = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, sampler_logp=sampler, options=uncapped)
    np.testing.assert_allclose(loss_untruncated, (3 * SURR_SUM_ROW0 + SURR_SUM_ROW1) / 5, rtol=1e-5)


def test_policy_loss_dual_clip_hand_computed():
    old = jnp.zeros((1, 2))
    logp = jnp.log(jnp.array([[4.0, 2.0]]))  # ratios 4 and 2, both with A = -1
    loss, m = L.clipped_policy_loss(
        logp, old, jnp.array([-1.0]), jnp.ones((1, 2)), options=L.PolicyLossOptions(dual_clip_c=3.0)
    )
    # r=4: min(4, c=3) = 3; r=2: 2 (below c) -> (3 + 2) / 2
    np.testing.assert_allclose(loss, 2.5, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction/dual"], 0.5)
    grad = jax.grad(
        lambda x: L.clipped_policy_loss(
            x, old, jnp.array([-1.0]), jnp.ones((1, 2)), options=L.PolicyLossOptions(dual_clip_c=3.0)
        )[0]
    )
    # dual-clipped token: no gradient; the other: -r A / 2 = 1
    np.testing.assert_allclose(grad(logp), [[0.0, 1.0]], rtol=1e-5, atol=1e-7)


def test_policy_loss_sequence_level_gspo_hand_computed():
    old = jnp.zeros((2, 3))
    logp = jnp.array([[0.1, 0.2, 0.3], [-0.1, 0.1, 40.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    a = jnp.array([1.0, -1.0])

    def f(x):
        return L.clipped_policy_loss(
            x, old, a, mask, surrogate="gspo", options=L.PolicyLossOptions(aggregation="seq-mean-token-mean")
        )

    loss, m = f(logp)
    # row 0: s = exp(mean(0.1, 0.2, 0.3)) = e^0.2 = 1.221403 > 1.2 with A>0 -> clipped, -1.2 per token
    # row 1: s = exp(mean(-0.1, 0.1)) = 1 -> -s A = 1 per token.  seq-mean-token-mean: (-1.2 + 1) / 2
    np.testing.assert_allclose(loss, -0.1, rtol=1e-5)
    np.testing.assert_allclose(m["clip_fraction/high"], 3 / 5)
    np.testing.assert_allclose(m["ratio/mean"], (3 * np.exp(0.2) + 2) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["ratio/max"], np.exp(0.2), rtol=1e-5)
    # gradient: row 0 clipped -> 0; row 1: (1 / S)(1 / L_1)(-s A) = (1/2)(1/2)(1) = 0.25 per valid token
    grad = jax.grad(lambda x: f(x)[0])(logp)
    np.testing.assert_allclose(grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="policy loss"):
        L.clipped_policy_loss(logp, old, a, mask, surrogate="seq")


def test_policy_loss_padding_garbage_changes_nothing():
    loss, m = L.clipped_policy_loss(LOGP, OLD, ADV, MASK)
    for junk in (jnp.nan, jnp.inf, -1e30):
        loss2, m2 = L.clipped_policy_loss(LOGP.at[1, 2].set(junk), OLD.at[1, 2].set(-junk), ADV, MASK)
        assert float(loss2) == float(loss)
        for k in m:
            assert float(m2[k]) == float(m[k]), k
        grad = jax.grad(lambda x, j=junk: L.clipped_policy_loss(x, OLD.at[1, 2].set(-j), ADV, MASK)[0])(
            LOGP.at[1, 2].set(junk)
        )
        assert np.isfinite(grad).all()


def test_surrogate_value_is_zero_at_ratio_one_but_gradient_is_not():
    # mu = 1, beta = 0: pi = pi_old so rho = 1; GRPO advantages of rewards [1, 0 | 0, 1] are [a, -a, -a, a]
    # with a = 0.5 / sqrt(0.5) = 0.707107 (see test_rl_advantages); completion lengths 3, 1, 1, 2
    a = 0.5 / np.sqrt(0.5)
    advs = jnp.array([a, -a, -a, a])
    mask = jnp.array([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    logp = jnp.full((4, 3), -1.0)

    def f(x, aggregation):
        return L.clipped_policy_loss(x, logp, advs, mask, options=L.PolicyLossOptions(aggregation=aggregation))[0]

    # seq-mean-token-mean: -(1/4) sum_i A_i = 0 because the advantages are zero-mean per group ...
    np.testing.assert_allclose(f(logp, "seq-mean-token-mean"), 0.0, atol=1e-7)
    # ... but the gradient per token is -(1/B)(1/|o_i|) A_i: row 0 -a/12, row 1 +a/4, row 2 +a/4, row 3 -a/8
    grad = jax.grad(f)(logp, "seq-mean-token-mean")
    expected = [[-a / 12] * 3, [a / 4, 0, 0], [a / 4, 0, 0], [-a / 8, -a / 8, 0]]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    # token-mean: the value is -sum_i |o_i| A_i / N = -(3a - a - a + 2a) / 7 = -3a/7, not 0 either way
    np.testing.assert_allclose(f(logp, "token-mean"), -3 * a / 7, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# policy loss properties
# ------------------------------------------------------------------------------------------------------


@jax.jit
def _loss_and_grad(logp, old, a, mask, eps_low, eps_high):
    def f(x):
        return L.clipped_policy_loss(
            x, old, a, mask, options=L.PolicyLossOptions(epsilon_low=eps_low, epsilon_high=eps_high)
        )[0]

    return jax.value_and_grad(f)(logp)


@jax.jit
def _plain_pg_loss_and_grad(logp, old, a, mask):
    def f(x):
        return lp.aggregate_loss(-jnp.exp(x - old) * a, mask)

    return jax.value_and_grad(f)(logp)


_SHAPE = (3, 4)
_UNIT = hnp.arrays(np.float32, _SHAPE, elements=st.floats(0.015625, 0.984375, width=32))
_ADVS = hnp.arrays(np.float32, _SHAPE, elements=st.floats(-3, 3, width=32).filter(lambda x: abs(x) > 1e-3))
_MASKS = hnp.arrays(np.int32, _SHAPE, elements=st.integers(0, 1))
_OLDS = hnp.arrays(np.float32, _SHAPE, elements=st.floats(-5, 0, width=32))


@PROPS
@given(
    u=_UNIT,
    a=_ADVS,
    mask=_MASKS,
    old=_OLDS,
    eps_low=st.floats(0.05, 0.4),
    eps_high=st.floats(0.05, 0.4),
)
def test_inside_clip_range_equals_plain_policy_gradient(u, a, mask, old, eps_low, eps_high):
    # ratios strictly inside [1 - eps_low, 1 + eps_high]
    lo, hi = np.log1p(-eps_low), np.log1p(eps_high)
    logp = (old + lo + (hi - lo) * u).astype(np.float32)
    args = (np.float32(eps_low), np.float32(eps_high))
    loss, grad = _loss_and_grad(logp, old, a, mask, *args)
    plain_loss, plain_grad = _plain_pg_loss_and_grad(logp, old, a, mask)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, plain_grad, rtol=1e-5, atol=1e-7)


@PROPS
@given(
    log_ratio=hnp.arrays(np.float32, _SHAPE, elements=st.floats(-1, 1, width=32)),
    a=_ADVS,
    mask=_MASKS,
    old=_OLDS,
)
def test_gradient_is_zero_exactly_where_clipped_on_the_pushing_side(log_ratio, a, mask, old):
    eps_low, eps_high = 0.2, 0.28
    ratio = np.exp(log_ratio.astype(np.float64))
    # stay away from the kinks, where the side is a matter of rounding
    assume(np.abs(ratio - (1 - eps_low)).min() > 1e-3 and np.abs(ratio - (1 + eps_high)).min() > 1e-3)
    logp = old + log_ratio
    _, grad = _loss_and_grad(logp, old, a, mask, np.float32(eps_low), np.float32(eps_high))
    clipped = ((a > 0) & (ratio > 1 + eps_high)) | ((a < 0) & (ratio < 1 - eps_low))
    n = max(int(mask.sum()), 1)
    expected = np.where(clipped | (mask == 0), 0.0, -np.exp(logp - old) * a / n)
    assert (np.asarray(grad)[clipped] == 0).all()
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# gradients of the composed loss vs finite differences
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dual_clip_c": 3.0, "epsilon_high": 0.28, "aggregation": "seq-mean-token-sum-norm", "max_len": 8},
        {"surrogate": "gspo", "aggregation": "seq-mean-token-mean"},
        # the 2025 objectives (tests/rl/test_objectives.py): the selections are piecewise constant, and the
        # entropies and covariances here are far enough apart that a step of 1e-3 never changes them
        {"surrogate": "sapo", "aggregation": "seq-mean-token-mean"},
        {"surrogate": "sapo", "settings": {"tau_pos": 3.0, "tau_neg": 5.0}},
        {"top_entropy_quantile": 0.5},
        {"top_entropy_quantile": 0.4, "surrogate": "sapo", "aggregation": "seq-mean-token-mean"},
        {"clip_cov_ratio": 0.3, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0},
        {"kl_cov_ratio": 0.3, "kl_cov_coef": 0.5},
    ],
)
def test_composed_loss_gradient_matches_finite_differences(options):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k1, (2, 4, 6))
    tokens = jax.random.randint(k2, (2, 4), 0, 6)
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    base = lp.token_logprobs(logits, tokens, temperature=0.8)
    # offsets put some tokens well inside and some well outside the clip range (no kink within FD reach)
    old = base + jnp.array([[0.05, -0.6, 0.4, 0.0], [0.1, -0.05, 0.7, -0.5]])
    ref = base + 0.3 * jax.random.normal(k3, (2, 4))
    a = jnp.array([1.0, -0.5])

    def loss(x):
        logp, ent = lp.token_logprobs_and_entropy(x, tokens, temperature=0.8)
        return L.clipped_policy_loss(
            logp, old, a, mask, ref_logp=ref, kl_coef=0.5, entropy=ent, entropy_coef=0.1, **with_options(options)
        )[0]

    # Tolerance chosen so that dropping the gradient of the ratio, the KL term or the entropy term
    # (a stop_gradient in the wrong place) fails this check.
    check_grads(jax.jit(loss), (logits,), order=1, modes=("rev",), eps=1e-3, atol=5e-4, rtol=5e-4)


# ------------------------------------------------------------------------------------------------------
# value loss and explained variance
# ------------------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    values = jnp.array([[1.0, 2.0, 0.0, 7.0]])
    old_values = jnp.array([[0.5, 2.5, 0.0, 7.0]])
    returns = jnp.array([[2.0, 2.0, 1.0, -7.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    # t0: V - V_old = 0.5 -> clipped to 0.2 -> V_clip 0.7; max((1-2)^2, (0.7-2)^2) = max(1, 1.69) -> 0.845
    # t1: V - V_old = -0.5 -> V_clip 2.3; max(0, 0.09) -> 0.045
    # t2: V = V_old -> max(1, 1) -> 0.5
    loss, m = L.clipped_value_loss(values, old_values, returns, mask, clip_range=0.2)
    np.testing.assert_allclose(loss, (0.845 + 0.045 + 0.5) / 3, rtol=1e-5)  # 0.463333
    np.testing.assert_allclose(m["value_clip_fraction"], 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(m["value/mean"], 1.0, rtol=1e-6)
    # no clipping: 0.5 * (1 + 0 + 1) / 3
    loss_nc, m_nc = L.clipped_value_loss(values, old_values, returns, mask, clip_range=None)
    np.testing.assert_allclose(loss_nc, 1 / 3, rtol=1e-5)
    assert float(m_nc["value_clip_fraction"]) == 0.0
    # gradient: t0 takes the clipped branch (constant in V) -> 0; t2: (V - R) / 3 = -1/3; t1: 0 (clipped)
    grad = jax.grad(lambda v: L.clipped_value_loss(v, old_values, returns, mask)[0])(values)
    np.testing.assert_allclose(grad, [[0.0, 0.0, -1 / 3, 0.0]], atol=1e-6)


def test_explained_variance_hand_computed():
    returns = jnp.array([[2.0, 2.0, 1.0, 50.0]])
    mask = jnp.array([[1, 1, 1, 0]])
    # Var[R] over [2, 2, 1] = 2/9; residual R - V = [0.5, 0, 0] has Var 1/18 -> 1 - (1/18) / (2/9) = 0.75
    values = jnp.array([[1.5, 2.0, 1.0, -50.0]])
    np.testing.assert_allclose(L.explained_variance(values, returns, mask), 0.75, rtol=1e-5)
    np.testing.assert_allclose(L.explained_variance(returns, returns, mask), 1.0)
    # constant returns: perfect prediction -> 1, anything else -> 0 (never nan)
    flat = jnp.ones((1, 3))
    assert float(L.explained_variance(flat, flat, jnp.ones((1, 3)))) == 1.0
    assert float(L.explained_variance(jnp.array([[0.0, 1.0, 2.0]]), flat, jnp.ones((1, 3)))) == 0.0


# ------------------------------------------------------------------------------------------------------
# DPO family
# ------------------------------------------------------------------------------------------------------

# pair 0: chosen log-ratio -10 - (-11) = 1, rejected -12 - (-11.5) = -0.5 -> h = 1.5
# pair 1: chosen -5 - (-4) = -1, rejected -6 - (-6.5) = 0.5 -> h = -1.5
PC, PR = jnp.array([-10.0, -5.0]), jnp.array([-12.0, -6.0])
RC, RR = jnp.array([-11.0, -4.0]), jnp.array([-11.5, -6.5])


def test_dpo_sigmoid_hand_computed():
    loss, m = L.dpo_loss(PC[:1], PR[:1], RC[:1], RR[:1], beta=0.1)
    # -log sigmoid(0.15) = log(1 + e^-0.15) = 0.620957
    np.testing.assert_allclose(loss, np.log1p(np.exp(-0.15)), rtol=1e-5)
    np.testing.assert_allclose(m["rewards/chosen"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(m["rewards/rejected"], -0.05, rtol=1e-5)
    np.testing.assert_allclose(m["rewards/margins"], 0.15, rtol=1e-5)
    assert float(m["rewards/accuracies"]) == 1.0
    # label smoothing 0.1: 0.9 * log(1 + e^-0.15) + 0.1 * log(1 + e^0.15) = 0.558861 + 0.077096
    smoothed, _ = L.dpo_loss(PC[:1], PR[:1], RC[:1], RR[:1], beta=0.1, label_smoothing=0.1)
    np.testing.assert_allclose(smoothed, 0.9 * np.log1p(np.exp(-0.15)) + 0.1 * np.log1p(np.exp(0.15)), rtol=1e-5)
    # both pairs: mean of 0.620957 and log(1 + e^0.15) = 0.770957; accuracy 1/2; margins cancel
    loss2, m2 = L.dpo_loss(PC, PR, RC, RR, beta=0.1)
    np.testing.assert_allclose(loss2, (np.log1p(np.exp(-0.15)) + np.log1p(np.exp(0.15))) / 2, rtol=1e-5)
    np.testing.assert_allclose(m2["rewards/accuracies"], 0.5)
    np.testing.assert_allclose(m2["rewards/margins"], 0.0, atol=1e-6)
    # masking the second pair recovers the single-pair numbers
    loss_m, m_m = L.dpo_loss(PC, PR, RC, RR, beta=0.1, mask=jnp.array([1, 0]))
    np.testing.assert_allclose(loss_m, loss, rtol=1e-6)
    np.testing.assert_allclose(m_m["logps/chosen"], -10.0)


def test_dpo_ipo_and_hinge_hand_computed():
    ipo, _ = L.dpo_loss(PC[:1], PR[:1], RC[:1], RR[:1], beta=0.1, loss_type="ipo")
    np.testing.assert_allclose(ipo, (1.5 - 1 / 0.2) ** 2, rtol=1e-5)  # (1.5 - 5)^2 = 12.25
    hinge, _ = L.dpo_loss(PC, PR, RC, RR, beta=0.1, loss_type="hinge")
    np.testing.assert_allclose(hinge, ((1 - 0.15) + (1 + 0.15)) / 2, rtol=1e-5)  # relu(1 - beta h)
    with pytest.raises(ValueError, match="loss_type"):
        L.dpo_loss(PC, PR, RC, RR, loss_type="kto")


def test_dpo_gradient_direction():
    # d loss / d chosen log-prob = -beta * sigmoid(-beta h) < 0: DPO pushes the chosen log-prob up
    g = jax.grad(lambda c: L.dpo_loss(c, PR[:1], RC[:1], RR[:1], beta=0.1)[0])(PC[:1])
    np.testing.assert_allclose(g, [-0.1 / (1 + np.exp(0.15))], rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# jit / vmap
# ------------------------------------------------------------------------------------------------------

_K = jax.random.split(jax.random.key(1), 5)
_LP = jax.random.normal(_K[0], (2, 5)) - 2.0
_OLD = _LP + 0.2 * jax.random.normal(_K[1], (2, 5))
_REF = _LP + 0.2 * jax.random.normal(_K[2], (2, 5))
_M = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
_A = jnp.array([0.7, -1.3])
_ENT = jnp.abs(jax.random.normal(_K[3], (2, 5)))
_VALS = jax.random.normal(_K[4], (2, 5))


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        *[(functools.partial(L.kl_penalty, estimator=e, clamp=5.0), (_LP, _REF)) for e in ("k1", "k2", "k3")],
        (lambda a, b, m: L.kl_penalty(a, b, mask=m), (_LP, _REF, _M)),
        (L.last_token_mask, (_M,)),
        (functools.partial(L.kl_shaped_token_rewards, kl_coef=0.05), (_A, _LP, _REF, _M)),
        (functools.partial(L.clipped_surrogate, dual_clip_c=3.0), (jnp.exp(_LP - _OLD), _A[:, None])),
        (functools.partial(L.truncated_importance_weights, cap=2.0), (_OLD, _REF, _M)),
        (L.clipped_policy_loss, (_LP, _OLD, _A, _M)),
        (
            functools.partial(
                L.clipped_policy_loss,
                surrogate="gspo",
                options=L.PolicyLossOptions(epsilon_high=0.28, dual_clip_c=3.0, aggregation="seq-mean-token-sum-norm"),
            ),
            (_LP, _OLD, _A, _M),
        ),
        (
            lambda lp_, old, a, m, ref, ent, samp: L.clipped_policy_loss(
                lp_, old, a, m, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01, sampler_logp=samp,
                options=L.PolicyLossOptions(rollout_correction="token_truncate"),
            ),
            (_LP, _OLD, _A, _M, _REF, _ENT, _REF),
        ),
        (L.explained_variance, (_VALS, _VALS + 0.3 * _LP, _M)),
        (L.clipped_value_loss, (_VALS, _VALS * 0.9, _VALS + 0.5, _M)),
        *[
            (functools.partial(L.dpo_loss, loss_type=t, label_smoothing=0.1), (PC, PR, RC, RR))
            for t in ("sigmoid", "ipo", "hinge")
        ],
    ],
)
def test_jit_and_vmap(fn, args):
    assert_jit_vmap_agree(fn, *args)


# ------------------------------------------------------------------------------------------------------
# the policy-loss registry
# ------------------------------------------------------------------------------------------------------


def vanilla_pg_loss(logp, old_logp, advantages, mask, *, epsilon_low=0.2, epsilon_high=0.2, dual_clip_c=None):
    """A policy loss from outside the package: the unclipped surrogate `-rho_t * A_t` (no trust region)."""
    ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
    return -ratio * advantages, ratio


def test_a_registered_policy_loss_is_used_by_the_composer():
    L.register_policy_loss("vanilla_pg_test")(vanilla_pg_loss)
    try:
        far = LOGP + jnp.array([[0.9, -0.9, 0.0], [0.5, 0.0, 0.0]])  # ratios far outside the clip range
        loss, m = L.clipped_policy_loss(far, OLD, ADV, MASK, surrogate="vanilla_pg_test")
        ratio = np.exp(np.where(np.asarray(MASK) > 0, np.asarray(far) - np.asarray(OLD), 0.0))
        by_hand = (-ratio * np.asarray(ADV)[:, None] * np.asarray(MASK)).sum() / np.asarray(MASK).sum()
        np.testing.assert_allclose(loss, by_hand, rtol=1e-6)
        clipped, _ = L.clipped_policy_loss(far, OLD, ADV, MASK)
        assert abs(float(clipped) - float(loss)) > 1e-3  # the clip binds there, so the registered loss was used
    finally:
        del L.POLICY_LOSSES["vanilla_pg_test"]


def test_a_plugin_policy_loss_with_a_setting_of_its_own_trains(tiny_task, tmp_path, monkeypatch):
    """docs/extending.md's `my_losses.py`, a file outside the package, trains through train.py as
    `rl.policy_loss=my_losses:capped_pg_loss` with `rl.policy_loss_kwargs={max_ratio: ...}`; the setting reaches the
    loss: `max_ratio: 0` zeroes the policy gradient exactly, `max_ratio: 5` trains. A key the function does not
    take is refused in one line before anything compiles."""
    import re

    import train
    from tests.runs import ROOT, read_rows, tiny_run_args

    page = (ROOT / "docs" / "extending.md").read_text()
    module = re.search(r"<!-- file: my_losses.py -->\n```python\n(.*?)```", page, re.S)[1]
    (tmp_path / "my_losses.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {}
    for max_ratio in (0.0, 5.0):
        out = tmp_path / f"run_{max_ratio}"
        code = train.cli(tiny_run_args(out, "data.eval=", "steps=1", "rl.policy_loss=my_losses:capped_pg_loss",
                                       f"rl.policy_loss_kwargs={{max_ratio: {max_ratio}}}",
                                       "rewards=[{name: 'tests.runs:starts_with_seven'}]", task=tiny_task))
        assert code == 0
        rows[max_ratio] = read_rows(out, having="grad_norm")[-1]
    assert rows[0.0]["policy_loss"] == 0.0 and rows[0.0]["grad_norm"] == 0.0
    assert rows[5.0]["frac_zero_std_groups"] < 1  # a learning signal: the zero above is the setting's
    assert np.isfinite(rows[5.0]["policy_loss"]) and rows[5.0]["grad_norm"] > 0
    assert train.cli(tiny_run_args(tmp_path / "x", "rl.policy_loss=my_losses:capped_pg_loss",
                                   "rl.policy_loss_kwargs={cap: 5.0}", task=tiny_task)) == 2
    assert train.cli(["out_dir=" + str(tmp_path / "y"), "rl.policy_loss=nope"]) == 2


def test_rollout_correction_weights_hand_computed():
    """TRL's four vllm_importance_sampling_modes on hand values: row 0 has token ratios (2, 0.5, 4), row 1
    (1.5, 1.5, padding). Sequence ratios are the products: 4 and 2.25."""
    old = jnp.zeros((2, 3))
    sampler = -jnp.log(jnp.array([[2.0, 0.5, 4.0], [1.5, 1.5, 9.0]]))
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    w = functools.partial(L.rollout_correction_weights, old, sampler, mask, cap=3.0)
    np.testing.assert_allclose(w(mode="token_truncate"), [[2, 0.5, 3], [1.5, 1.5, 0]], rtol=1e-5)
    np.testing.assert_allclose(w(mode="token_mask"), [[2, 0.5, 0], [1.5, 1.5, 0]], rtol=1e-5)
    np.testing.assert_allclose(w(mode="sequence_truncate"), [[3, 3, 3], [2.25, 2.25, 0]], rtol=1e-5)
    np.testing.assert_allclose(w(mode="sequence_mask"), [[0, 0, 0], [2.25, 2.25, 0]], rtol=1e-5)
    with pytest.raises(ValueError, match="expected one of"):
        w(mode="turn_mask")
    from jaxrl_llm.rl.options import ROLLOUT_CORRECTIONS

    # the loss-weighting modes are the config's choices but the two that only pick the old log-probs
    assert ROLLOUT_CORRECTION_MODES == ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    assert ROLLOUT_CORRECTIONS == ("none", "recompute", *ROLLOUT_CORRECTION_MODES)
    # in the loss: the masked sequence (row 0) leaves the policy gradient, row 1 is weighted by 2.25
    adv = jnp.array([1.0, 1.0])
    masked = L.PolicyLossOptions(rollout_correction="sequence_mask", rollout_correction_cap=3.0)
    loss, m = L.clipped_policy_loss(old, old, adv, mask, sampler_logp=sampler, options=masked)
    np.testing.assert_allclose(loss, -(2.25 * 2) / 5, rtol=1e-5)  # token-mean of -r A w over 5 tokens, r = 1
    np.testing.assert_allclose(m["is_weight/masked_fraction"], 3 / 5, rtol=1e-6)
    grad = jax.grad(lambda x: L.clipped_policy_loss(x, old, adv, mask, sampler_logp=sampler, options=masked)[0])(old)
    np.testing.assert_allclose(grad[0], 0.0)
    np.testing.assert_allclose(grad[1, :2], -2.25 / 5, rtol=1e-5)


def test_logprob_mismatch_hand_computed():
    trainer = jnp.array([[0.0, -1.0, -2.0]])
    sampler = jnp.array([[0.0, -1.0 - np.log(2.0), 5.0]])
    m = L.logprob_mismatch(trainer, sampler, jnp.array([[1, 1, 0]]))
    np.testing.assert_allclose(m["mismatch/logprob_abs_mean"], np.log(2.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["mismatch/logprob_abs_max"], np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(m["mismatch/ratio_std"], np.std([1.0, 2.0]), rtol=1e-6)  # ratios 1 and 2
