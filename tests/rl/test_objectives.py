"""The 2025 objectives: CISPO and SAPO surrogates, high-entropy token selection, Clip-Cov / KL-Cov, adaptive
entropy control (jaxrl_llm.rl.surrogates, token_selection, entropy_control), each by hand, by finite differences, by a
property, and one GRPO trainer run with it on the tiny model."""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from pathlib import Path

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
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.preflight import load_config
from jaxrl_llm.rl import entropy_control as ec
from jaxrl_llm.rl.surrogates import token_log_ratio
from jaxrl_llm.trainers import make_trainer
from tests.batches import with_options
from tests.numerics import assert_jit_vmap_agree
from tests.runs import ROOT, assert_config_refused, read_rows, tiny_run

pytestmark = pytest.mark.quick

PROPS = settings(max_examples=40, deadline=None)

# The hand-computed batch of test_rl_losses: pi_old = 0.5 everywhere, ratios below, one padded position holding
# garbage (log-ratio 100), A = +1 for row 0 and -1 for row 1, N = 5 valid tokens.
OLD = jnp.full((2, 3), np.log(0.5)).at[1, 2].set(-50.0)
RATIOS = jnp.array([[1.0, 1.5, 0.5], [0.7, 1.1, 1.0]])
LOGP = (OLD + jnp.log(RATIOS)).at[1, 2].set(50.0)
ADV = jnp.array([1.0, -1.0])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])


def _grad(logp, *args, **options):
    return jax.grad(lambda x: L.clipped_policy_loss(x, *args, **with_options(options))[0])(logp)


# ------------------------------------------------------------------------------------------------------
# CISPO
# ------------------------------------------------------------------------------------------------------


def test_cispo_hand_computed_value_and_gradient():
    loss, m = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, surrogate="cispo")
    # w = clip(r, 0.8, 1.2): row 0 [1.0, 1.2, 0.8], row 1 [0.8, 1.1]; pi = 0.5 r: [0.5, 0.75, 0.25], [0.35, 0.55]
    #   l = -w A log pi: 0.693147, 0.345216, 1.109035 | -0.839853, -0.657626; token-mean over 5
    by_hand = (0.693147 + 0.345216 + 1.109035 - 0.839853 - 0.657626) / 5
    np.testing.assert_allclose(loss, by_hand, rtol=1e-5)
    np.testing.assert_allclose(m["policy_loss"], by_hand, rtol=1e-5)
    # grad = -w A / N on every valid token: none dropped, even where ppo_clip drops r=1.5 (A>0) and r=0.7 (A<0)
    np.testing.assert_allclose(_grad(LOGP, OLD, ADV, MASK, surrogate="cispo"),
                               [[-0.2, -0.24, -0.16], [0.16, 0.22, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(_grad(LOGP, OLD, ADV, MASK), [[-0.2, 0.0, -0.1], [0.0, 0.22, 0.0]], rtol=1e-5,
                               atol=1e-7)
    with pytest.raises(ValueError, match="dual clip"):
        L.clipped_policy_loss(LOGP, OLD, ADV, MASK, surrogate="cispo", options=L.PolicyLossOptions(dual_clip_c=3.0))


def test_cispo_with_trl_settings_caps_the_weight_only_above():
    # TRL / ScaleRL: w = sg(min(r, eps_max)), eps_max = 5, no lower bound -> epsilon_low=1, epsilon_high=4 here
    ratios = jnp.array([[0.01, 0.5, 3.0, 6.0, 40.0]])
    old = jnp.full((1, 5), np.log(0.01))
    logp = old + jnp.log(ratios)
    grad = _grad(logp, old, jnp.array([1.0]), jnp.ones((1, 5)), surrogate="cispo", epsilon_low=1.0, epsilon_high=4.0)
    np.testing.assert_allclose(grad, -np.minimum(np.asarray(ratios), 5.0) / 5, rtol=1e-5)


_SHAPE = (3, 4)
_ADVS = hnp.arrays(np.float32, _SHAPE, elements=st.floats(-3, 3, width=32).filter(lambda x: abs(x) > 1e-3))
_MASKS = hnp.arrays(np.int32, _SHAPE, elements=st.integers(0, 1))
_OLDS = hnp.arrays(np.float32, _SHAPE, elements=st.floats(-5, -0.125, width=32))
_LOG_RATIOS = hnp.arrays(np.float32, _SHAPE, elements=st.floats(-1, 1, width=32))


@PROPS
@given(log_ratio=_LOG_RATIOS, a=_ADVS, mask=_MASKS, old=_OLDS)
def test_cispo_keeps_a_gradient_on_every_token(log_ratio, a, mask, old):
    """Every valid token's gradient is nonzero (-w A / N, w > 0), also where the ratio is outside the clip range and
    ppo_clip's is exactly 0; inside the range the two gradients are the same."""
    logp = old + log_ratio
    grad = np.asarray(_grad(logp, old, a, mask, surrogate="cispo", epsilon_high=0.28))
    valid = mask > 0
    assert (grad[valid] != 0).all() and (grad[~valid] == 0).all()
    ratio = np.exp(log_ratio.astype(np.float64))
    n = max(int(mask.sum()), 1)
    np.testing.assert_allclose(grad, np.where(valid, -np.clip(ratio, 0.8, 1.28) * a / n, 0.0), rtol=1e-4, atol=1e-7)
    inside = valid & (ratio > 0.8 + 1e-3) & (ratio < 1.28 - 1e-3)
    ppo = np.asarray(_grad(logp, old, a, mask, epsilon_high=0.28))
    np.testing.assert_allclose(grad[inside], ppo[inside], rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------------------------------
# SAPO
# ------------------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_sapo_hand_computed_value_and_gradient():
    loss, _ = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, surrogate="sapo")
    # tau = 1 for row 0 (A > 0), 1.05 for row 1; f(r) = sigmoid(tau (r - 1)) 4 / tau, l = -f(r) A
    #   r = 1.5, A = 1: s = sigmoid(0.5) = 0.622459, f = 2.489837, l = -2.489837
    #   r = 0.7, A = -1: s = sigmoid(-0.315) = 0.421895, f = 1.607218, l = +1.607218
    r = np.asarray(RATIOS)
    tau = np.array([[1.0], [1.05]])
    s = _sigmoid(tau * (r - 1))
    per_token = -(s * 4 / tau) * np.array([[1.0], [-1.0]])
    np.testing.assert_allclose(per_token[0, 1], -2.489837, rtol=1e-6)
    np.testing.assert_allclose(per_token[1, 0], 1.607218, rtol=1e-6)
    np.testing.assert_allclose(loss, (per_token * np.asarray(MASK)).sum() / 5, rtol=1e-5)
    # grad wrt log pi: -4 s (1 - s) r A / N; r = 1.5, A = 1: -(4 * 0.622459 * 0.377541) * 1.5 / 5 = -0.282003
    expected = -4 * s * (1 - s) * r * np.array([[1.0], [-1.0]]) * np.asarray(MASK) / 5
    np.testing.assert_allclose(expected[0, 1], -0.282003, rtol=1e-5)
    np.testing.assert_allclose(_grad(LOGP, OLD, ADV, MASK, surrogate="sapo"), expected, rtol=1e-5, atol=1e-7)
    # the temperatures are options of the surrogate
    loss2, _ = L.clipped_policy_loss(LOGP, OLD, ADV, MASK, surrogate="sapo", settings={"tau_pos": 2.0, "tau_neg": 3.0})
    tau2 = np.array([[2.0], [3.0]])
    by_hand = (-(_sigmoid(tau2 * (r - 1)) * 4 / tau2) * np.array([[1.0], [-1.0]]) * np.asarray(MASK)).sum() / 5
    np.testing.assert_allclose(loss2, by_hand, rtol=1e-5)


@jax.jit
def _sapo_grad_at(log_ratio: jax.Array, a: jax.Array, tau_pos: jax.Array, tau_neg: jax.Array) -> jax.Array:
    old = jnp.full((1, 1), np.log(0.3))
    return _grad(old + log_ratio, old, a[None], jnp.ones((1, 1)), surrogate="sapo",
                 settings={"tau_pos": tau_pos, "tau_neg": tau_neg})[0, 0]


def _sapo_token_grad(ratio: float, a: float, tau_pos: float = 1.0, tau_neg: float = 1.05) -> float:
    """d l / d log pi of one SAPO token with the given ratio and advantage (temperatures traced: one compile)."""
    return float(_sapo_grad_at(jnp.float32(np.log(ratio)), jnp.float32(a), jnp.float32(tau_pos),
                               jnp.float32(tau_neg)))


@PROPS
@given(a=_ADVS, mask=_MASKS, old=_OLDS, tau_pos=st.floats(0.1, 20.0), tau_neg=st.floats(0.1, 20.0))
def test_sapo_at_ratio_one_is_the_unclipped_gradient(a, mask, old, tau_pos, tau_neg):
    # f'(1) = 4 sigmoid(0) (1 - sigmoid(0)) = 1 for any temperature: grad = -A / N, as -r A's at r = 1
    grad = _grad(old, old, a, mask, surrogate="sapo", settings={"tau_pos": tau_pos, "tau_neg": tau_neg})
    n = max(int(mask.sum()), 1)
    np.testing.assert_allclose(grad, np.where(mask > 0, -a / n, 0.0), rtol=1e-5, atol=1e-7)


def test_sapo_gate_is_smooth_and_tends_to_hard_gating_and_to_the_plain_gradient():
    ratios = np.linspace(0.5, 1.5, 201)
    sapo = np.array([_sapo_token_grad(r, 1.0) for r in ratios])
    ppo_grad = jax.jit(lambda x: _grad(x, jnp.full((1, 1), -1.0), jnp.array([1.0]), jnp.ones((1, 1)))[0, 0])
    ppo = np.array([float(ppo_grad(jnp.full((1, 1), np.log(r) - 1.0))) for r in ratios])
    # smooth: no jump between neighbouring ratios (steps of 0.005 move it by < 0.01); ppo_clip's drops at
    # 1 + eps_high from -1.2 to 0 (through -0.9 at the kink itself)
    assert np.abs(np.diff(sapo)).max() < 0.01
    assert np.abs(np.diff(ppo)).max() > 0.5
    # tau -> infinity: a hard gate, no gradient once the ratio leaves 1 (here by 0.05), the full one at 1
    assert abs(_sapo_token_grad(1.05, 1.0, tau_pos=2000.0)) < 1e-12
    assert abs(_sapo_token_grad(0.95, -1.0, tau_neg=2000.0)) < 1e-12
    np.testing.assert_allclose(_sapo_token_grad(1.0, 1.0, tau_pos=2000.0), -1.0, rtol=1e-6)
    # tau -> 0: the unclipped policy gradient -r A
    np.testing.assert_allclose(_sapo_token_grad(1.4, 1.0, tau_pos=1e-3), -1.4, rtol=1e-4)
    np.testing.assert_allclose(_sapo_token_grad(0.6, -1.0, tau_neg=1e-3), 0.6, rtol=1e-4)


def test_sapo_uses_tau_pos_for_positive_and_tau_neg_for_negative_advantages():
    base = dict(tau_pos=1.0, tau_neg=1.05)
    for a, changed, kept in ((1.0, "tau_pos", "tau_neg"), (-1.0, "tau_neg", "tau_pos")):
        g = _sapo_token_grad(1.3, a, **base)
        assert _sapo_token_grad(1.3, a, **{**base, kept: 9.0}) == g  # the other sign's temperature is not read
        moved = _sapo_token_grad(1.3, a, **{**base, changed: 9.0})
        assert abs(moved) < abs(g)  # a hotter gate damps the token more


# ------------------------------------------------------------------------------------------------------
# High-entropy token selection
# ------------------------------------------------------------------------------------------------------

ENT = jnp.array([[0.5, 2.0, 1.0], [3.0, 0.1, 9.0]])  # 9.0 sits at the padded position: never selected


def test_top_entropy_hand_computed():
    # 5 valid tokens; q = 0.4 -> ceil(2) = 2 tokens: entropies 3.0 and 2.0
    sel = L.top_entropy_token_mask(ENT, MASK, quantile=0.4)
    np.testing.assert_array_equal(sel, [[False, True, False], [True, False, False]])
    # q = 0.5 -> ceil(2.5) = 3: adds 1.0; q = 0.01 -> at least one token
    assert int(L.top_entropy_token_mask(ENT, MASK, quantile=0.5).sum()) == 3
    np.testing.assert_array_equal(L.top_entropy_token_mask(ENT, MASK, quantile=0.01), [[0, 0, 0], [1, 0, 0]])
    loss, m = L.clipped_policy_loss(
        LOGP, OLD, ADV, MASK, entropy=ENT, options=L.PolicyLossOptions(top_entropy_quantile=0.4)
    )
    # ppo_clip per token (test_rl_losses): row 0 [-1, -1.2, -0.5], row 1 [0.8, 1.1]; selected (0,1) and (1,0);
    # the denominator stays all 5 valid tokens
    np.testing.assert_allclose(loss, (-1.2 + 0.8) / 5, rtol=1e-5)
    np.testing.assert_allclose(m["top_entropy_fraction"], 2 / 5)
    grad = _grad(LOGP, OLD, ADV, MASK, entropy=ENT, top_entropy_quantile=0.4)
    np.testing.assert_array_equal(np.asarray(grad) != 0, [[False, False, False], [False, False, False]])  # both clipped
    grad = _grad(LOGP, OLD, ADV, MASK, entropy=ENT, top_entropy_quantile=0.5)  # adds (0,2): r=0.5, A>0
    np.testing.assert_allclose(grad, [[0.0, 0.0, -0.1], [0.0, 0.0, 0.0]], atol=1e-7)
    with pytest.raises(ValueError, match="entropy"):
        L.clipped_policy_loss(LOGP, OLD, ADV, MASK, options=L.PolicyLossOptions(top_entropy_quantile=0.5))
    with pytest.raises(ValueError, match="quantile"):
        L.top_entropy_token_mask(ENT, MASK, quantile=0.0)


@PROPS
@given(entropy=hnp.arrays(np.float32, (4, 5), elements=st.floats(0, 10, width=32, allow_subnormal=False)),
       mask=hnp.arrays(np.int32, (4, 5), elements=st.integers(0, 1)), percent=st.integers(1, 100))
def test_top_entropy_selects_exactly_ceil_q_n_valid_tokens_of_highest_entropy(entropy, mask, percent):
    q = percent / 100
    sel = np.asarray(L.top_entropy_token_mask(entropy, mask, quantile=q))
    n = int(mask.sum())
    assert sel.sum() == math.ceil(Fraction(percent, 100) * n)
    assert not sel[mask == 0].any()
    chosen, left = entropy[sel], entropy[(mask > 0) & ~sel]
    if chosen.size and left.size:
        assert chosen.min() >= left.max()


@pytest.mark.parametrize("surrogate", ["ppo_clip", "gspo", "cispo", "sapo"])
def test_top_entropy_works_with_every_surrogate(surrogate):
    """Unselected tokens get no policy gradient; selected ones the gradient they have without the option."""
    key = jax.random.key(3)
    logp = jnp.log(jax.random.uniform(key, (3, 4), minval=0.05, maxval=0.95))
    old = logp + 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (3, 4))
    ent = jax.random.uniform(jax.random.fold_in(key, 2), (3, 4), maxval=3.0)
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    adv = jnp.array([1.0, -0.5, 2.0])
    full = np.asarray(_grad(logp, old, adv, mask, surrogate=surrogate, entropy=ent))
    part = np.asarray(_grad(logp, old, adv, mask, surrogate=surrogate, entropy=ent, top_entropy_quantile=0.3))
    sel = np.asarray(L.top_entropy_token_mask(ent, mask, quantile=0.3))
    assert sel.sum() == 3  # ceil(0.3 * 9)
    assert (part[~sel] == 0).all()
    np.testing.assert_allclose(part[sel], full[sel], rtol=1e-6)


@pytest.mark.parametrize("surrogate", ["ppo_clip", "cispo"])
def test_top_entropy_quantile_one_is_the_unselected_loss_bit_for_bit(surrogate):
    f = functools.partial(L.clipped_policy_loss, surrogate=surrogate, entropy=ENT, entropy_coef=0.1)
    (loss, m), grad = jax.value_and_grad(lambda x: f(x, OLD, ADV, MASK), has_aux=True)(LOGP)
    unselected = with_options({"top_entropy_quantile": 1.0})
    (loss1, m1), grad1 = jax.value_and_grad(lambda x: f(x, OLD, ADV, MASK, **unselected), has_aux=True)(LOGP)
    np.testing.assert_array_equal(loss1, loss)
    np.testing.assert_array_equal(grad1, grad)
    assert m1.keys() == m.keys()


# ------------------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov
# ------------------------------------------------------------------------------------------------------

# log pi: row 0 [-1, -2, -0.5], row 1 [-3, -1.5, pad]; mean -1.6. A: +1, -1; mean 0.2.
# cov = (A - 0.2)(log pi + 1.6): row 0 0.8 * [0.6, -0.4, 1.1] = [0.48, -0.32, 0.88]; row 1 -1.2 * [-1.4, 0.1] =
# [1.68, -0.12]
COV_LOGP = jnp.array([[-1.0, -2.0, -0.5], [-3.0, -1.5, 7.0]])
COV = np.array([[0.48, -0.32, 0.88], [1.68, -0.12, 0.0]])
LOG_RATIO = jnp.array([[0.1, 0.15, 0.15], [-0.1, 0.05, 0.0]])  # all inside the clip range of 0.2 / 0.2


def test_token_covariance_hand_computed():
    adv = jnp.broadcast_to(ADV[:, None], (2, 3))
    np.testing.assert_allclose(L.token_covariance(COV_LOGP, adv, MASK), COV, rtol=1e-5, atol=1e-6)


def test_clip_cov_hand_computed():
    old = COV_LOGP - LOG_RATIO
    base = np.asarray(_grad(COV_LOGP, old, ADV, MASK))
    # band (0.5, 1.5): only 0.88 at (0, 2) (1.68 is above, 0.48 below); max(floor(0.2 * 5), 1) = 1 token
    options = dict(clip_cov_ratio=0.2, clip_cov_lb=0.5, clip_cov_ub=1.5)
    loss, m = L.clipped_policy_loss(COV_LOGP, old, ADV, MASK, **with_options(options))
    grad = np.asarray(_grad(COV_LOGP, old, ADV, MASK, **options))
    assert grad[0, 2] == 0 and base[0, 2] != 0
    keep = np.ones((2, 3), bool)
    keep[0, 2] = False
    np.testing.assert_array_equal(grad[keep], base[keep])
    np.testing.assert_allclose(m["clip_cov_fraction"], 1 / 5)
    # verl's corr: the detached token's loss is 0 (r = e^0.15, A = +1: ppo_clip's -1.161834), the rest unchanged
    base_loss = L.clipped_policy_loss(COV_LOGP, old, ADV, MASK)[0]
    np.testing.assert_allclose(loss, base_loss + np.exp(0.15) / 5, rtol=1e-6)
    # band (0.4, 1.5) holds 0.88 and 0.48; fraction 0.4 -> 2 tokens; verl's 2e-4 -> max(floor(0.001), 1) = 1
    two = np.asarray(L.clip_cov_token_mask(jnp.asarray(COV), MASK, jnp.ones((2, 3), bool), fraction=0.4, lower=0.4,
                                           upper=1.5))
    np.testing.assert_array_equal(two, [[True, False, True], [False, False, False]])
    one = np.asarray(L.clip_cov_token_mask(jnp.asarray(COV), MASK, jnp.ones((2, 3), bool), fraction=2e-4,
                                           lower=0.4, upper=1.5))
    np.testing.assert_array_equal(one, [[False, False, True], [False, False, False]])  # the highest in the band
    # a token the PPO clip already stopped (r = e^0.3 > 1.2 with A > 0) is not eligible: the next one is taken
    clipped_old = old.at[0, 2].add(-0.15)
    grad = np.asarray(_grad(COV_LOGP, clipped_old, ADV, MASK, clip_cov_ratio=0.2, clip_cov_lb=0.4, clip_cov_ub=1.5))
    assert grad[0, 0] == 0 and grad[0, 2] == 0 and grad[0, 1] != 0 and grad[1, 1] != 0


def test_kl_cov_hand_computed():
    old = COV_LOGP - LOG_RATIO
    base_loss = float(L.clipped_policy_loss(COV_LOGP, old, ADV, MASK)[0])
    base = np.asarray(_grad(COV_LOGP, old, ADV, MASK))
    # fraction 0.4 -> 2 tokens of highest covariance: 1.68 at (1, 0) and 0.88 at (0, 2) (no band)
    loss, m = L.clipped_policy_loss(
        COV_LOGP, old, ADV, MASK, options=L.PolicyLossOptions(kl_cov_ratio=0.4, kl_cov_coef=0.1)
    )
    # + 0.1 * (|-0.1| + |0.15|) / 5 = 0.005
    np.testing.assert_allclose(float(loss) - base_loss, 0.005, rtol=1e-4)
    np.testing.assert_allclose(m["kl_cov_fraction"], 2 / 5)
    grad = np.asarray(_grad(COV_LOGP, old, ADV, MASK, kl_cov_ratio=0.4, kl_cov_coef=0.1))
    # d/d log pi of 0.1 |log pi - log pi_old| / 5 = 0.02 sign(log r): -0.02 at (1, 0), +0.02 at (0, 2)
    np.testing.assert_allclose(grad - base, [[0, 0, 0.02], [-0.02, 0, 0]], atol=1e-7)
    np.testing.assert_array_equal(L.kl_cov_token_mask(jnp.asarray(COV), MASK, fraction=2e-4),
                                  [[False, False, False], [True, False, False]])


_COV_ARRAYS = hnp.arrays(np.float32, (3, 4), elements=st.floats(-3, 0, width=32))


def _cov_count(percent: int, n: int) -> int:
    """verl's max(int(fraction * n), 1), in exact arithmetic."""
    return max(math.floor(Fraction(percent, 100) * n), 1)


_LOWERS = st.floats(-2, 0.5, width=32, allow_subnormal=False)  # XLA on CPU flushes subnormals to 0


@PROPS
@given(logp=_COV_ARRAYS, a=_ADVS, mask=_MASKS, log_ratio=hnp.arrays(np.float32, (3, 4),
       elements=st.floats(-0.375, 0.375, width=32)), percent=st.integers(1, 50), lower=_LOWERS)
def test_clip_cov_detaches_exactly_the_highest_covariance_tokens_in_the_band(logp, a, mask, log_ratio, percent,
                                                                              lower):
    assume(mask.sum() > 0)
    fraction = percent / 100
    old = logp - log_ratio
    lower, upper = np.float32(lower), np.float32(lower + 1.5)
    cov = np.asarray(L.token_covariance(logp, a, mask))
    ratio = np.exp(log_ratio.astype(np.float64))
    clipped = ((a < 0) & (ratio < 0.8)) | ((a > 0) & (ratio > 1.2))
    assume(np.abs(ratio - 0.8).min() > 1e-4 and np.abs(ratio - 1.2).min() > 1e-4)  # no rounding at the kinks
    band = (mask > 0) & ~clipped & (cov > lower) & (cov < upper)
    options = dict(clip_cov_ratio=fraction, clip_cov_lb=float(lower), clip_cov_ub=float(upper))
    detached = np.asarray(L.clip_cov_token_mask(jnp.asarray(cov), mask, jnp.asarray(~clipped), fraction=fraction,
                                                lower=float(lower), upper=float(upper)))
    assert detached.sum() == min(_cov_count(percent, int(mask.sum())), band.sum())
    assert not detached[~band].any()
    if detached.any() and (band & ~detached).any():
        assert cov[detached].min() >= cov[band & ~detached].max()
    grad = np.asarray(_grad(logp, old, a, mask, **options))
    base = np.asarray(_grad(logp, old, a, mask))
    assert (grad[detached] == 0).all()
    np.testing.assert_array_equal(grad[~detached], base[~detached])


@PROPS
@given(logp=_COV_ARRAYS, a=_ADVS, mask=_MASKS, log_ratio=hnp.arrays(np.float32, (3, 4),
       elements=st.floats(-0.125, 0.125, width=32)), percent=st.integers(1, 50), coef=st.floats(0.01, 2.0))
def test_kl_cov_adds_exactly_coef_abs_log_ratio_on_the_top_covariance_tokens(logp, a, mask, log_ratio, percent,
                                                                             coef):
    assume(mask.sum() > 0)
    fraction = percent / 100
    old = logp - log_ratio
    cov = np.asarray(L.token_covariance(logp, a, mask))
    chosen = np.asarray(L.kl_cov_token_mask(jnp.asarray(cov), mask, fraction=fraction))
    assert chosen.sum() == _cov_count(percent, int(mask.sum()))
    left = (mask > 0) & ~chosen
    if left.any():
        assert cov[chosen].min() >= cov[left].max()
    with_kl = float(
        L.clipped_policy_loss(logp, old, a, mask, options=L.PolicyLossOptions(kl_cov_ratio=fraction, kl_cov_coef=coef))[
            0
        ]
    )
    without = float(L.clipped_policy_loss(logp, old, a, mask)[0])
    lr = np.asarray(token_log_ratio(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask)))
    np.testing.assert_allclose(with_kl - without, coef * np.abs(lr)[chosen].sum() / mask.sum(), rtol=1e-4,
                               atol=3e-6)


# ------------------------------------------------------------------------------------------------------
# gradients of the composed loss with each objective vs finite differences
# ------------------------------------------------------------------------------------------------------


# The composed loss with each new option vs finite differences: tests/rl/test_losses.py
# (test_composed_loss_gradient_matches_finite_differences), parametrised with them.


@pytest.mark.parametrize("options", [{}, {"epsilon_low": 1.0, "epsilon_high": 4.0,
                                          "aggregation": "seq-mean-token-mean"}])
def test_cispo_gradient_matches_finite_differences_of_its_objective(options):
    """CISPO's value carries a stop-gradient, so it is not its own gradient's antiderivative: the check is against
    the paper's objective J(theta) = agg(w A log pi_theta) with the weight w = clip(r) frozen at the point."""
    k1, k2 = jax.random.split(jax.random.key(1))
    logits = jax.random.normal(k1, (2, 4, 6))
    tokens = jax.random.randint(k2, (2, 4), 0, 6)
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    base = lp.token_logprobs(logits, tokens, temperature=0.8)
    old = base + jnp.array([[0.05, -0.6, 0.4, 0.0], [0.1, -0.05, 0.7, -0.5]])  # ratios inside and outside
    a = jnp.array([1.0, -0.5])
    clip = {k: options.get(k, 0.2) for k in ("epsilon_low", "epsilon_high")}
    agg = options.get("aggregation", "token-mean")
    frozen_w = jnp.clip(jnp.exp(base - old), 1 - clip["epsilon_low"], 1 + clip["epsilon_high"])

    def objective(x):
        logp = lp.token_logprobs(x, tokens, temperature=0.8)
        return lp.aggregate_loss(-frozen_w * a[:, None] * logp, mask, agg)

    def library(x):
        logp = lp.token_logprobs(x, tokens, temperature=0.8)
        return L.clipped_policy_loss(logp, old, a, mask, surrogate="cispo", **with_options(options))[0]

    grad = jax.grad(library)(logits)
    np.testing.assert_allclose(grad, jax.grad(objective)(logits), rtol=1e-5, atol=1e-7)
    check_grads(jax.jit(objective), (logits,), order=1, modes=("rev",), eps=1e-3, atol=5e-4, rtol=5e-4)
    for i in range(3):  # and directly: central differences of the objective along random directions
        v = jax.random.normal(jax.random.fold_in(k1, i), logits.shape)
        fd = (objective(logits + 1e-3 * v) - objective(logits - 1e-3 * v)) / 2e-3
        np.testing.assert_allclose(float(jnp.vdot(grad, v)), float(fd), rtol=2e-3, atol=2e-4)


_LP = jnp.log(jnp.array([[0.2, 0.5, 0.7, 0.1], [0.4, 0.3, 0.9, 0.6]]))
_OLD = _LP + jnp.array([[0.1, -0.2, 0.3, 0.0], [0.05, 0.25, -0.3, 0.1]])
_A = jnp.array([1.0, -0.5])
_M = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
_ENT = jnp.array([[1.0, 0.2, 2.0, 0.5], [0.7, 1.5, 0.1, 0.9]])


@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(L.clipped_policy_loss, surrogate="cispo"),
        functools.partial(L.clipped_policy_loss, surrogate="sapo"),
        functools.partial(L.clipped_policy_loss, options=L.PolicyLossOptions(top_entropy_quantile=0.5)),
        functools.partial(
            L.clipped_policy_loss, options=L.PolicyLossOptions(clip_cov_ratio=0.3, clip_cov_lb=-10.0, clip_cov_ub=10.0)
        ),
        functools.partial(L.clipped_policy_loss, options=L.PolicyLossOptions(kl_cov_ratio=0.3)),
    ],
)
def test_objectives_jit_and_vmap(fn):
    assert_jit_vmap_agree(lambda lp_, old, a, m, ent: fn(lp_, old, a, m, entropy=ent), _LP, _OLD, _A, _M, _ENT)


# ------------------------------------------------------------------------------------------------------
# Adaptive entropy control
# ------------------------------------------------------------------------------------------------------

_ENTROPY_CTL = jax.jit(functools.partial(ec.adaptive_entropy_update, target=0.2, delta=0.005, min_coef=0.0,
                                         max_coef=1.0))


def test_entropy_controller_hand_computed():
    state = ec.init_entropy_controller(0.01)
    assert state.coef.dtype == jnp.float32 and state.coef.shape == () and float(state.active) == 1.0
    np.testing.assert_allclose(ec.applied_entropy_coef(state), 0.01)
    up = _ENTROPY_CTL(state, 0.1)  # below target: alpha + delta, bonus on
    np.testing.assert_allclose(up.coef, 0.015, rtol=1e-6)
    np.testing.assert_allclose(ec.applied_entropy_coef(up), 0.015, rtol=1e-6)
    down = _ENTROPY_CTL(state, 0.3)  # above target: alpha - delta, bonus off
    np.testing.assert_allclose(down.coef, 0.005, rtol=1e-5)
    assert float(down.active) == 0.0 and float(ec.applied_entropy_coef(down)) == 0.0
    at_target = _ENTROPY_CTL(state, 0.2)  # not below (Skywork's strict <): down
    np.testing.assert_allclose(at_target.coef, 0.005, rtol=1e-5)
    # clamped to [min, max]
    assert float(_ENTROPY_CTL(ec.init_entropy_controller(0.0), 5.0).coef) == 0.0
    assert float(_ENTROPY_CTL(ec.init_entropy_controller(0.998), 0.0).coef) == 1.0
    assert ec.entropy_controller_update(state, 0.1, kind="fixed") is state
    np.testing.assert_allclose(ec.entropy_controller_update(state, 0.1, kind="adaptive", target=0.2, delta=0.005).coef,
                               0.015, rtol=1e-6)
    with pytest.raises(ValueError, match="delta"):
        ec.adaptive_entropy_update(state, 0.1, target=0.2, delta=-1.0)
    with pytest.raises(ValueError, match="target and delta"):
        ec.entropy_controller_update(state, 0.1, kind="adaptive")
    with pytest.raises(ValueError, match="unknown entropy controller"):
        ec.entropy_controller_update(state, 0.1, kind="pid")


_COEFS = st.floats(0.0, 0.5, width=32, allow_subnormal=False)  # XLA on CPU flushes subnormals to 0


@settings(max_examples=25, deadline=None)
@given(entropy=st.floats(0.0, 5.0), coef=_COEFS, target=st.floats(0.01, 3.0), delta=st.floats(1e-4, 0.1),
       max_coef=_COEFS)
def test_entropy_controller_moves_towards_the_target_and_stays_in_bounds(entropy, coef, target, delta, max_coef):
    state = ec.init_entropy_controller(min(coef, max_coef))
    new = ec.adaptive_entropy_update(state, entropy, target=target, delta=delta, max_coef=max_coef)
    before, after = float(state.coef), float(new.coef)
    assert 0.0 <= after <= np.float32(max_coef)
    below = np.float32(entropy) < np.float32(target)
    assert float(new.active) == float(below)
    if below:
        assert after > before or after == np.float32(max_coef)
    else:
        assert after < before or after == 0.0


def test_entropy_controller_scans_and_vmaps():
    def step(state, h):
        new = ec.adaptive_entropy_update(state, h, target=0.5, delta=0.1, max_coef=0.25)
        return new, ec.applied_entropy_coef(new)

    final, applied = jax.jit(lambda s: jax.lax.scan(step, s, jnp.array([0.1, 0.1, 0.1, 0.9, 0.1])))(
        ec.init_entropy_controller(0.0))
    np.testing.assert_allclose(applied, [0.1, 0.2, 0.25, 0.0, 0.25], rtol=1e-6)  # 0.25 - 0.1 + 0.1, capped
    assert isinstance(final, ec.EntropyControllerState)
    states = ec.EntropyControllerState(coef=jnp.array([0.1, 0.2]), active=jnp.ones(2))
    batched = jax.vmap(functools.partial(ec.adaptive_entropy_update, target=0.5, delta=0.05))(states,
                                                                                            jnp.array([0.0, 1.0]))
    np.testing.assert_allclose(batched.coef, [0.15, 0.15], rtol=1e-6)
    np.testing.assert_array_equal(batched.active, [1.0, 0.0])


# ------------------------------------------------------------------------------------------------------
# Config: names, ranges and relations
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,match",
    [
        ("rl.loss.top_entropy_quantile=0", "rl.loss.top_entropy_quantile=0"),
        ("rl.loss.top_entropy_quantile=1.5", "rl.loss.top_entropy_quantile"),
        ("rl.sapo_tau_pos=2", "rl.sapo_tau_pos .* was renamed to rl.policy_loss_kwargs.tau_pos"),
        ("rl.epsilon_high=0.28", "rl.epsilon_high .* was renamed to rl.loss.epsilon_high"),
        ("rl.loss.clip_cov_ratio=-0.1", "rl.loss.clip_cov_ratio"),
        ("rl.loss.kl_cov_coef=-1", "rl.loss.kl_cov_coef"),
        ("rl.entropy_target=-1", "rl.entropy_target"),
    ],
)
def test_config_range_checks(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_config_relations():
    assert_config_refused(["rl.loss.clip_cov_ratio=0.01", "rl.loss.clip_cov_lb=5", "rl.loss.clip_cov_ub=1"],
                          "clip_cov_lb")
    assert_config_refused(["rl.policy_loss=cispo", "rl.loss.dual_clip_c=3"], "dual_clip_c")
    assert_config_refused(["algo=ppo", "rl.entropy_target=0.2"], "GRPO family")
    assert_config_refused(["rl.entropy_target=0.2", "rl.entropy_coef=2.0"], "entropy_coef_min")
    c = load_config(None, ["rl.policy_loss=sapo", "rl.loss.top_entropy_quantile=0.2", "rl.entropy_target=0.2"])
    assert c.rl.policy_loss == "sapo" and c.rl.policy_loss_kwargs == {}  # sapo_loss's own defaults (1.0, 1.05)
    # a surrogate's settings are checked against its signature: its own keywords, scalar values
    assert_config_refused(["rl.policy_loss=sapo", "rl.policy_loss_kwargs={tau: 2.0}"],
                          "rl.policy_loss_kwargs.tau: rl.policy_loss=sapo takes tau_pos, tau_neg")
    assert_config_refused(["rl.policy_loss_kwargs={epsilon_high: 0.3}"],
                          "rl.policy_loss_kwargs.epsilon_high: .* takes no settings of its own")
    assert_config_refused(["rl.policy_loss=sapo", "rl.policy_loss_kwargs={tau_pos: [1, 2]}"],
                          "a setting is a number, a string or a boolean")
    c = load_config(None, ["rl.policy_loss=sapo", "rl.policy_loss_kwargs={tau_pos: 2.0, tau_neg: 3.0}"])
    assert c.rl.policy_loss_kwargs == {"tau_pos": 2.0, "tau_neg": 3.0}


def test_bench_rows_are_valid_configs():
    """The bench's rows (not run here) load: each preset with its overrides passes validation."""
    from bench.algorithms import ALGORITHMS

    keys = {a.key for a in ALGORITHMS}
    assert {"cispo", "sapo", "top_entropy", "clip_cov", "kl_cov", "entropy_control"} <= keys
    for alg in ALGORITHMS:
        c = load_config(ROOT / "configs" / alg.config, [f"algo={alg.algo}", *alg.overrides])
        assert c.algo == alg.algo


# ------------------------------------------------------------------------------------------------------
# End to end: one GRPO trainer step with each option on the tiny model
# ------------------------------------------------------------------------------------------------------


def _config(task: Path, out: Path, *overrides: str):
    return tiny_run("grpo_arithmetic", out, "data.eval=''",
                    "rewards=[{name: math_answer}, {name: 'tests.runs:completion_length'}]", *overrides, task=task)


@pytest.mark.parametrize(
    "overrides,metric",
    [
        (("rl.policy_loss=cispo", "rl.loss.epsilon_low=1.0", "rl.loss.epsilon_high=4.0", "rl.mu=2"), "policy_loss"),
        (("rl.policy_loss=sapo", "rl.loss.aggregation=seq-mean-token-mean", "rl.mu=2"), "policy_loss"),
        (("rl.loss.top_entropy_quantile=0.2",), "top_entropy_fraction"),
        (("rl.loss.clip_cov_ratio=0.05", "rl.loss.clip_cov_lb=0.0"), "clip_cov_fraction"),
        (("rl.loss.kl_cov_ratio=0.05", "rl.mu=2"), "kl_cov_fraction"),
    ],
)
def test_a_grpo_step_runs_with_each_objective(tiny_task, tmp_path, overrides, metric):
    out = tmp_path / "run"
    make_trainer(_config(tiny_task, out, "steps=1", "checkpoint_every=0", *overrides)).run()
    (row,) = read_rows(out, "reward/mean")
    assert all(np.isfinite(row[k]) for k in ("policy_loss", "grad_norm", "entropy", metric))
    assert row["grad_norm"] > 0
    if metric.endswith("fraction"):
        assert 0 < row[metric] <= 0.25


def test_a_traced_entropy_coef_replaces_the_configured_one_in_the_policy_loss():
    """The adaptive controller's coefficient reaches the loss as a traced keyword (`train_step`'s loss_inputs)."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss
    from tests.families import TINY

    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    cm = (np.arange(5)[None] < rng.integers(1, 6, 4)[:, None]).astype(np.int32)
    batch = PolicyBatch(Sequences(jnp.asarray(rng.integers(3, 19, (4, 3)), jnp.int32), jnp.ones((4, 3), jnp.int32),
                        jnp.asarray(rng.integers(3, 19, (4, 5)), jnp.int32), jnp.asarray(cm)),
                        jnp.zeros((4, 5)), jnp.zeros((4, 5)), jnp.asarray(rng.normal(size=4), jnp.float32))
    counts = dict(model_config=config, num_tokens=jnp.float32(cm.sum()), num_seqs=jnp.float32(4))
    fixed, _ = policy_loss(params, batch, loss_config=PolicyObjective(entropy_coef=0.5), **counts)
    traced, _ = jax.jit(lambda c: policy_loss(params, batch, loss_config=PolicyObjective(), entropy_coef=c,
                                              **counts))(jnp.float32(0.5))
    plain, metrics = policy_loss(params, batch, loss_config=PolicyObjective(), **counts)
    np.testing.assert_allclose(traced, fixed, rtol=1e-6)
    np.testing.assert_allclose(float(plain) - float(traced), 0.5 * float(metrics["entropy"]), rtol=1e-4)


def test_adaptive_entropy_control_steers_checkpoints_and_resumes(tiny_task, tmp_path):
    """The coefficient starts at rl.entropy_coef, rises by delta per step while the entropy is below target (a
    random model is far below 10 nats), is logged as entropy_coef, and comes back from the checkpoint."""
    out = tmp_path / "run"
    options = ("rl.entropy_target=10.0", "rl.entropy_coef=0.0", "rl.entropy_coef_delta=0.01", "checkpoint_every=2",
               "rl.grad_accum=2")
    trainer = make_trainer(_config(tiny_task, out, "steps=2", *options))
    assert "entropy_controller" in trainer.state
    trainer.run()
    np.testing.assert_allclose([r["entropy_coef"] for r in read_rows(out, "reward/mean")], [0.0, 0.01], rtol=1e-6)
    resumed = make_trainer(_config(tiny_task, out, "steps=3", *options), resume=True)
    np.testing.assert_allclose(resumed.state["entropy_controller"]["coef"], 0.02, rtol=1e-6)  # restored, not 0
    resumed.run()
    np.testing.assert_allclose([r["entropy_coef"] for r in read_rows(out, "reward/mean")], [0.0, 0.01, 0.02], rtol=1e-6)
    # a fixed coefficient keeps the checkpoint's old shape
    fixed = make_trainer(_config(tiny_task, tmp_path / "fixed", "steps=0", "checkpoint_every=0"))
    assert "entropy_controller" not in fixed.state
