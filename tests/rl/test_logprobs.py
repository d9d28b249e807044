"""Tests for jaxrl_llm.rl.logprobs: log-probs, entropy, chunked forms, masked reductions, aggregation."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxrl_llm.rl as lp
from tests.numerics import assert_jit_vmap_agree

pytestmark = pytest.mark.quick

LN2 = np.log(2.0)
# Jitted once per static config: a compiled call is several times faster than eager op-by-op dispatch.
_STATIC = ("chunk_size", "with_entropy")
chunked_jit = jax.jit(lp.token_logprobs_chunked, static_argnames=_STATIC)
from_hidden_jit = jax.jit(lp.token_logprobs_from_hidden, static_argnames=_STATIC)
direct_jit = jax.jit(lp.token_logprobs_and_entropy)


# ------------------------------------------------------------------------------------------------------
# log-probs and entropy
# ------------------------------------------------------------------------------------------------------


def test_token_logprobs_hand_computed():
    # logits = log([1, 2, 1]) -> probs [0.25, 0.5, 0.25]; token 1 -> log 0.5, token 0 -> log 0.25.
    logits = jnp.log(jnp.array([[[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]]))
    tokens = jnp.array([[1, 0]])
    np.testing.assert_allclose(lp.token_logprobs(logits, tokens), [[-LN2, -2 * LN2]], rtol=1e-6)
    # temperature 2 -> logits / 2 = log(sqrt([1, 2, 1])) -> p(1) = sqrt2 / (2 + sqrt2) = 0.414214
    expected_t2 = np.log(np.sqrt(2.0) / (2.0 + np.sqrt(2.0)))
    np.testing.assert_allclose(lp.token_logprobs(logits, tokens, temperature=2.0)[0, 0], expected_t2, rtol=1e-6)


def test_token_logprobs_float32_from_bf16():
    logits = jnp.log(jnp.array([[[1.0, 2.0, 1.0]]])).astype(jnp.bfloat16)
    out = lp.token_logprobs(logits, jnp.array([[1]]))
    assert out.dtype == jnp.float32
    # bf16 rounds log 2 to 0.69140625, so p(1) = 2^x / (2 + 2^x) with that rounding; just check closeness.
    np.testing.assert_allclose(out, [[-LN2]], atol=5e-3)


def test_token_entropy_hand_computed():
    # uniform over 4 -> ln 4; [0.5, 0.25, 0.25] -> 0.5 ln2 + 2 * 0.25 ln4 = 1.5 ln2
    logits = jnp.stack([jnp.zeros(4), jnp.log(jnp.array([0.5, 0.25, 0.25, 0.0]))])[None]
    ent = lp.token_entropy(logits)
    np.testing.assert_allclose(ent, [[2 * LN2, 1.5 * LN2]], rtol=1e-6)
    # a -inf logit (zero probability) must not turn the entropy into nan
    assert np.isfinite(ent).all()
    logp, ent2 = lp.token_logprobs_and_entropy(logits, jnp.array([[3, 0]]))
    np.testing.assert_allclose(logp, [[-2 * LN2, -LN2]], rtol=1e-6)
    np.testing.assert_allclose(ent2, ent, rtol=1e-6)


def test_token_logprobs_pad_id_out_of_range_is_finite():
    logits = jnp.zeros((1, 2, 5))
    out = lp.token_logprobs(logits, jnp.array([[2, -100]]))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, 0], -np.log(5.0), rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 64])  # many exact chunks / ragged tail / one partial chunk
def test_chunked_equals_direct(chunk_size):
    key1, key2 = jax.random.split(jax.random.key(0))
    logits = 4.0 * jax.random.normal(key1, (2, 7, 33))
    tokens = jax.random.randint(key2, (2, 7), 0, 33)
    # (the log-prob-only path, with_entropy=False, is covered by the bf16 and gradient tests)
    direct_lp, direct_ent = direct_jit(logits, tokens, temperature=0.7)
    c_lp, c_ent = chunked_jit(logits, tokens, temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    np.testing.assert_allclose(c_lp, direct_lp, atol=1e-5)
    np.testing.assert_allclose(c_ent, direct_ent, atol=1e-5)


def test_chunked_bf16_logits_equal_direct():
    key1, key2 = jax.random.split(jax.random.key(1))
    logits = (3.0 * jax.random.normal(key1, (2, 6, 50))).astype(jnp.bfloat16)
    tokens = jax.random.randint(key2, (2, 6), 0, 50)
    out = chunked_jit(logits, tokens, chunk_size=4)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, direct_jit(logits, tokens)[0], atol=1e-5)


def test_from_hidden_equals_direct_values_and_gradients():
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(k1, (2, 9, 8))
    unembed = jax.random.normal(k2, (8, 40)) / np.sqrt(8.0)
    tokens = jax.random.randint(k3, (2, 9), 0, 40)
    weights = jnp.linspace(-1.0, 1.0, 18).reshape(2, 9)

    def direct(h, w):
        logp, ent = lp.token_logprobs_and_entropy(h @ w, tokens, temperature=0.9)
        return jnp.sum(weights * logp) + jnp.sum(ent)

    def chunked(h, w):
        logp, ent = lp.token_logprobs_from_hidden(h, w, tokens, temperature=0.9, chunk_size=4, with_entropy=True)
        return jnp.sum(weights * logp) + jnp.sum(ent)

    for a, b in zip(
        from_hidden_jit(hidden, unembed, tokens, temperature=0.9, chunk_size=4, with_entropy=True),
        direct_jit(hidden @ unembed, tokens, temperature=0.9),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-5)
    g_direct = jax.jit(jax.grad(direct, argnums=(0, 1)))(hidden, unembed)
    g_chunked = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, unembed)
    for a, b in zip(g_chunked, g_direct, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_chunked_logits_gradient_matches_direct():
    k1, k2 = jax.random.split(jax.random.key(3))
    logits = jax.random.normal(k1, (2, 5, 12))
    tokens = jax.random.randint(k2, (2, 5), 0, 12)
    g_direct = jax.jit(jax.grad(lambda x: lp.token_logprobs(x, tokens).sum()))(logits)
    g_chunked = jax.jit(jax.grad(lambda x: lp.token_logprobs_chunked(x, tokens, chunk_size=2).sum()))(logits)
    np.testing.assert_allclose(g_chunked, g_direct, atol=1e-6)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        lp.token_logprobs_chunked(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), chunk_size=0)


# ------------------------------------------------------------------------------------------------------
# masked reductions
# ------------------------------------------------------------------------------------------------------


def test_masked_reductions_hand_computed_and_ignore_nonfinite_padding():
    x = jnp.array([[1.0, 2.0, jnp.inf], [4.0, jnp.nan, -jnp.inf]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    assert float(lp.masked_sum(x, mask)) == 7.0  # 1 + 2 + 4
    np.testing.assert_allclose(lp.masked_sum(x, mask, axis=-1), [3.0, 4.0])
    np.testing.assert_allclose(lp.masked_mean(x, mask), 7.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(lp.masked_mean(x, mask, axis=-1), [1.5, 4.0])
    # values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9
    np.testing.assert_allclose(lp.masked_var(x, mask), 42.0 / 9.0 / 3.0, rtol=1e-6)
    np.testing.assert_allclose(lp.masked_var(x, mask, ddof=1), 42.0 / 9.0 / 2.0, rtol=1e-6)
    assert float(lp.masked_max(x, mask)) == 4.0
    assert float(lp.masked_min(x, mask)) == 1.0
    np.testing.assert_allclose(lp.masked_min(x, mask, axis=-1), [1.0, 4.0])


def test_masked_reductions_all_masked_give_zero():
    x = jnp.array([[3.0, 5.0]])
    mask = jnp.zeros((1, 2))
    for fn in (lp.masked_mean, lp.masked_var, lp.masked_max, lp.masked_min):
        assert float(fn(x, mask)) == 0.0


# ------------------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------------------

PER_TOKEN = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, (1 + 2 + 3 + 5 + 6) / 5),  # 3.4
        ("seq-mean-token-mean", {}, ((1 + 2 + 3) / 3 + (5 + 6) / 2) / 2),  # (2 + 5.5) / 2 = 3.75
        ("seq-mean-token-sum", {}, ((1 + 2 + 3) + (5 + 6)) / 2),  # 8.5
        ("seq-mean-token-sum-norm", {}, (6 / 4 + 11 / 4) / 2),  # max_len defaults to T = 4: 2.125
        ("seq-mean-token-sum-norm", {"max_len": 10}, (6 / 10 + 11 / 10) / 2),  # 0.85
        ("token-mean", {"num_tokens": 10.0}, 17 / 10),  # explicit global count
        ("seq-mean-token-sum", {"num_seqs": 4.0}, 17 / 4),
    ],
)
def test_aggregate_loss_hand_computed(mode, kwargs, expected):
    out = lp.aggregate_loss(PER_TOKEN, MASK, mode, **kwargs)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_aggregate_loss_fully_masked_row_is_ignored():
    per_token = jnp.concatenate([PER_TOKEN, jnp.full((1, 4), 100.0)])
    mask = jnp.concatenate([MASK, jnp.zeros((1, 4), MASK.dtype)])
    for mode in lp.AGGREGATION_MODES:
        np.testing.assert_allclose(
            lp.aggregate_loss(per_token, mask, mode), lp.aggregate_loss(PER_TOKEN, MASK, mode), rtol=1e-6
        )


def test_aggregate_loss_unknown_mode():
    with pytest.raises(ValueError, match="aggregation mode"):
        lp.aggregate_loss(PER_TOKEN, MASK, "mean")


_AGG_JIT = {m: jax.jit(functools.partial(lp.aggregate_loss, mode=m)) for m in lp.AGGREGATION_MODES}


@settings(max_examples=40, deadline=None)
@given(
    per_token=hnp.arrays(np.float32, (3, 5), elements=st.floats(-10, 10, width=32)),
    mask=hnp.arrays(np.int32, (3, 5), elements=st.integers(0, 1)),
    junk=hnp.arrays(np.float32, (3, 5), elements=st.floats(-1e6, 1e6, width=32)),
    mode=st.sampled_from(lp.AGGREGATION_MODES),
)
def test_aggregation_ignores_masked_values_exactly(per_token, mask, junk, mode):
    changed = np.where(mask > 0, per_token, junk)
    fn = _AGG_JIT[mode]
    assert float(fn(per_token, mask)) == float(fn(changed, mask))
    nan_padded = np.where(mask > 0, per_token, np.nan)
    assert float(fn(nan_padded, mask)) == float(fn(per_token, mask))


@pytest.mark.parametrize("mode", lp.AGGREGATION_MODES)
def test_microbatch_accumulation_with_global_counts_equals_full_batch(mode):
    k1, k2 = jax.random.split(jax.random.key(4))
    x = jax.random.normal(k1, (6, 5))
    mask = (jax.random.uniform(k2, (6, 5)) > 0.3).astype(jnp.int32).at[:, 0].set(1)
    w = jnp.linspace(0.5, 2.0, 5)
    num_tokens = mask.sum()
    num_seqs = (mask.sum(-1) > 0).sum()

    @jax.jit
    def loss_and_grad(weights, xs, m, num_tokens=None, num_seqs=None):
        def loss(wt):
            return lp.aggregate_loss(xs * wt, m, mode, max_len=8, num_tokens=num_tokens, num_seqs=num_seqs)

        return jax.value_and_grad(loss)(weights)

    def loss(weights, xs, m, **counts):
        return loss_and_grad(weights, xs, m, **counts)[0]

    full, full_grad = loss_and_grad(w, x, mask)
    micro = [(x[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)]
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    accumulated = sum(loss_and_grad(w, xs, m, **counts)[0] for xs, m in micro)
    accumulated_grad = sum(loss_and_grad(w, xs, m, **counts)[1] for xs, m in micro)
    np.testing.assert_allclose(accumulated, full, rtol=1e-5)
    np.testing.assert_allclose(accumulated_grad, full_grad, rtol=1e-5, atol=1e-6)
    # without the global counts the micro-batch means do not add up to the full-batch mean
    naive = sum(loss(w, xs, m) for xs, m in micro)
    assert abs(float(naive) - float(full)) > 1e-3


# ------------------------------------------------------------------------------------------------------
# jit / vmap
# ------------------------------------------------------------------------------------------------------

_LOGITS = jax.random.normal(jax.random.key(5), (2, 5, 9))
_TOKENS = jax.random.randint(jax.random.key(6), (2, 5), 0, 9)
_HIDDEN = jax.random.normal(jax.random.key(7), (2, 5, 4))
_UNEMBED = jax.random.normal(jax.random.key(8), (4, 9))
_X = jax.random.normal(jax.random.key(9), (2, 5))
_M = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (functools.partial(lp.token_logprobs, temperature=0.8), (_LOGITS, _TOKENS)),
        (functools.partial(lp.token_entropy, temperature=0.8), (_LOGITS,)),
        (lp.token_logprobs_and_entropy, (_LOGITS, _TOKENS)),
        (functools.partial(lp.token_logprobs_chunked, chunk_size=2, with_entropy=True), (_LOGITS, _TOKENS)),
        (functools.partial(lp.token_logprobs_from_hidden, chunk_size=2), (_HIDDEN, _UNEMBED, _TOKENS)),
        (lp.masked_sum, (_X, _M)),
        (lp.masked_mean, (_X, _M)),
        (functools.partial(lp.masked_var, ddof=1), (_X, _M)),
        (lp.masked_min, (_X, _M)),
        (lp.masked_max, (_X, _M)),
        *[(functools.partial(lp.aggregate_loss, mode=m), (_X, _M)) for m in lp.AGGREGATION_MODES],
    ],
)
def test_jit_and_vmap(fn, args):
    assert_jit_vmap_agree(fn, *args)
