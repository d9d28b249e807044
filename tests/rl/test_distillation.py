"""Distillation's math (`jaxrl_llm.rl.distillation`): hand-computed values, an independent numpy reference of GKD's
generalised JSD (TRL's definition), its properties, the chunked form, and the reverse-KL policy gradient's exact
expectation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.rl.distillation import generalized_jsd, generalized_jsd_from_hidden, reverse_kl_advantages
from jaxrl_llm.rl.surrogates import ppo_clip_loss

pytestmark = pytest.mark.quick


def numpy_jsd(zs: np.ndarray, zt: np.ndarray, beta: float, temperature: float = 1.0) -> np.ndarray:
    """TRL's `generalized_jsd_loss` per position, in float64 numpy (the reference)."""
    def log_softmax(z):
        z = z / temperature
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    ls, lt = log_softmax(zs.astype(np.float64)), log_softmax(zt.astype(np.float64))
    if beta == 0:
        return (np.exp(lt) * (lt - ls)).sum(-1)
    if beta == 1:
        return (np.exp(ls) * (ls - lt)).sum(-1)
    m = beta * np.exp(lt) + (1 - beta) * np.exp(ls)
    return beta * (np.exp(lt) * (lt - np.log(m))).sum(-1) + (1 - beta) * (np.exp(ls) * (ls - np.log(m))).sum(-1)


def test_reverse_kl_advantages_by_hand():
    student = jnp.array([[-0.5, -2.0, -1.0]])
    teacher = jnp.array([[-0.1, -3.0, -9.0]])
    mask = jnp.array([[1, 1, 0]])
    adv = reverse_kl_advantages(student, teacher, mask, coef=2.0)
    np.testing.assert_allclose(np.asarray(adv), [[2 * 0.4, 2 * -1.0, 0.0]], rtol=1e-6)


def test_generalized_jsd_two_token_vocabulary_by_hand():
    """p_S = (1/2, 1/2), p_T = (0.9, 0.1), beta = 1/2: m = (0.7, 0.3)."""
    zs = jnp.log(jnp.array([0.5, 0.5]))
    zt = jnp.log(jnp.array([0.9, 0.1]))
    kl_t = 0.9 * math.log(0.9 / 0.7) + 0.1 * math.log(0.1 / 0.3)
    kl_s = 0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3)
    assert float(generalized_jsd(zs, zt, beta=0.5)) == pytest.approx(0.5 * kl_t + 0.5 * kl_s, rel=1e-5)
    forward = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)  # KL(p_T || p_S)
    reverse = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # KL(p_S || p_T)
    assert float(generalized_jsd(zs, zt, beta=0.0)) == pytest.approx(forward, rel=1e-5)
    assert float(generalized_jsd(zs, zt, beta=1.0)) == pytest.approx(reverse, rel=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_equals_the_numpy_reference(beta, temperature):
    rng = np.random.default_rng(0)
    zs, zt = rng.normal(size=(3, 5, 17)) * 2, rng.normal(size=(3, 5, 17)) * 2
    ours = generalized_jsd(jnp.asarray(zs, jnp.float32), jnp.asarray(zt, jnp.float32), beta=beta,
                           temperature=temperature)
    np.testing.assert_allclose(np.asarray(ours), numpy_jsd(zs, zt, beta, temperature), rtol=2e-5, atol=1e-6)


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 10_000), st.floats(0.05, 0.95))
def test_generalized_jsd_properties(seed, beta):
    """Non-negative, zero for equal distributions, bounded by the log of the mixture weights, and at beta = 1/2
    symmetric in the two distributions."""
    rng = np.random.default_rng(seed)
    zs, zt = jnp.asarray(rng.normal(size=(4, 9)) * 3, jnp.float32), jnp.asarray(rng.normal(size=(4, 9)) * 3,
                                                                               jnp.float32)
    jsd = np.asarray(generalized_jsd(zs, zt, beta=beta))
    assert (jsd >= -1e-6).all()
    # JSD_beta <= -beta log beta - (1 - beta) log(1 - beta) (the mixture's entropy bound)
    assert (jsd <= -beta * math.log(beta) - (1 - beta) * math.log(1 - beta) + 1e-5).all()
    np.testing.assert_allclose(np.asarray(generalized_jsd(zs, zs, beta=beta)), 0.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(generalized_jsd(zs, zt, beta=0.5)),
                               np.asarray(generalized_jsd(zt, zs, beta=0.5)), rtol=1e-5, atol=1e-6)


def test_generalized_jsd_gradient_equals_finite_differences():
    rng = np.random.default_rng(1)
    zs, zt = rng.normal(size=(7,)), rng.normal(size=(7,))
    f = lambda z: generalized_jsd(z, jnp.asarray(zt, jnp.float32), beta=0.3)  # noqa: E731 (float32 inside)
    grad = np.asarray(jax.grad(f)(jnp.asarray(zs, jnp.float32)))
    eps = 1e-2  # central differences: O(eps^2) error, far above float32 rounding
    fd = [(float(f(jnp.asarray(zs + eps * e, jnp.float32))) - float(f(jnp.asarray(zs - eps * e, jnp.float32))))
          / (2 * eps) for e in np.eye(7)]
    np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=2e-4)
    assert np.abs(grad).max() > 1e-2
    # the teacher's logits carry no gradient
    assert float(jnp.abs(jax.grad(lambda z: generalized_jsd(jnp.asarray(zs), z, beta=0.3))(jnp.asarray(zt))).max()) == 0


def test_chunked_jsd_from_hidden_equals_one_block_with_gradients():
    rng = np.random.default_rng(2)
    hs, ws = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32), jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
    ht, wt = jnp.asarray(rng.normal(size=(2, 7, 6)), jnp.float32), jnp.asarray(rng.normal(size=(6, 13)), jnp.float32)

    def total(h, chunk):
        return generalized_jsd_from_hidden(h, ws, ht, wt, beta=0.4, chunk_size=chunk).sum()

    full = generalized_jsd_from_hidden(hs, ws, ht, wt, beta=0.4, chunk_size=7)
    np.testing.assert_allclose(np.asarray(full), numpy_jsd(np.asarray(hs @ ws), np.asarray(ht @ wt), 0.4),
                               rtol=1e-4, atol=1e-6)
    chunked = generalized_jsd_from_hidden(hs, ws, ht, wt, beta=0.4, chunk_size=3)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(jax.grad(total)(hs, 3)), np.asarray(jax.grad(total)(hs, 7)), rtol=1e-5,
                               atol=1e-6)


def test_reverse_kl_policy_gradient_is_the_reverse_kl_gradient_in_expectation():
    """One step over a vocabulary of 6: the expectation over y ~ pi of the clipped surrogate's gradient with the
    per-token advantage `log pi_T(y) - log pi_old(y)` (at theta = old, so no clipping) equals
    grad KL(pi_theta || pi_T) exactly (sum_y grad pi(y) = 0 removes the score term)."""
    rng = np.random.default_rng(3)
    theta = jnp.asarray(rng.normal(size=6), jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    log_teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6), theta.dtype))
    old = jax.lax.stop_gradient(jax.nn.log_softmax(theta))

    def expected_surrogate(t):
        logp = jax.nn.log_softmax(t)
        ys = jnp.arange(6)
        adv = reverse_kl_advantages(old[ys][:, None], log_teacher[ys][:, None], jnp.ones((6, 1)))
        per_token, _ = ppo_clip_loss(logp[ys][:, None], old[ys][:, None], adv, jnp.ones((6, 1)))
        return (jnp.exp(old) * per_token[:, 0]).sum()  # E_{y ~ pi_old}[loss of y]

    def reverse_kl(t):
        logp = jax.nn.log_softmax(t)
        return (jnp.exp(logp) * (logp - log_teacher)).sum()

    np.testing.assert_allclose(np.asarray(jax.grad(expected_surrogate)(theta)), np.asarray(jax.grad(reverse_kl)(theta)),
                               rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(jax.grad(reverse_kl)(theta)).max()) > 1e-2


def test_jsd_of_tied_embeddings_as_stored_equals_the_transposed_view_and_runs_bf16_dots():
    """`generalized_jsd_from_hidden(..., student_transposed=True, teacher_transposed=True)` with `[V, D]` embeddings
    equals the same with `embedding.T`, values and gradients; and in bf16 the compiled gradient has no dot of
    float32 operands (a transposed view is folded into the dot and upcast on XLA:CPU)."""
    from tests.numerics import compiled_dot_operand_types

    rng = np.random.default_rng(7)
    hs, ht = (jnp.asarray(rng.normal(size=(4, 24, d)), jnp.float32) for d in (32, 48))
    es, et = (jnp.asarray(rng.normal(size=(256, d)) / np.sqrt(d), jnp.float32) for d in (32, 48))

    def total(h, e, transposed, dtype, teacher=et):
        ws, wt = (e, teacher) if transposed else (e.T, teacher.T)
        return generalized_jsd_from_hidden(h, ws, ht, wt, beta=0.3, chunk_size=8, compute_dtype=dtype,
                                           student_transposed=transposed, teacher_transposed=transposed).sum()

    for dtype in (jnp.float32, jnp.bfloat16):
        want = jax.value_and_grad(total, argnums=(0, 1))(hs, es, False, dtype)
        got = jax.value_and_grad(total, argnums=(0, 1))(hs, es, True, dtype)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6)
    # the teacher's dot runs in its weights' dtype: bf16, as a bf16 run's teacher copy is stored
    grad = jax.jit(jax.grad(lambda h, e: total(h, e, True, jnp.bfloat16, et.astype(jnp.bfloat16)), argnums=(0, 1)))
    types = compiled_dot_operand_types(grad.lower(hs, es).compile().as_text())
    assert types and all(t == ("bf16", "bf16") for t in types), types
