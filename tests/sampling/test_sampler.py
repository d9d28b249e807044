"""Sampler: greedy parity with transformers' generate, sampling distributions, log-probs, EOS, buckets, CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrl_llm import sampling as sampling_module
from jaxrl_llm.errors import UsageError
from jaxrl_llm.models.decode import decode_layers, decode_token, init_caches, loop_caches, split_layers
from jaxrl_llm.models.decoder import forward
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.layers import positions_from_mask
from jaxrl_llm.models.step_weights import step_weights
from jaxrl_llm.sampling import Knobs, SamplingConfig, bucket_prompts, compiled_program_count, sample
from jaxrl_llm.sampling.logits import sample_from_logits, truncate_logits
from tests.families import FAMILIES, hf_generate, left_padded_batch, make_hf_model
from tests.numerics import fresh_logits, gather_logprobs
from tests.runs import STORIES260K, requires_shared

pytestmark = pytest.mark.heavy(seconds=46)

PAD = 0


def _knobs(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> Knobs:
    return sampling_module.knobs_from_config(
        SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    )


# ------------------------------------------------------------------------------------------ greedy parity


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_greedy_matches_transformers_generate(kind, hf_model_dir):
    """A left-padded batch (prompt lengths 1..12, bucketed to 16) gives HF's greedy tokens for 40 new tokens."""
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=11)
    expected = hf_generate(make_hf_model(kind), tokens, mask, 40)
    greedy = SamplingConfig(max_new_tokens=40, greedy=True, prompt_bucket=16, new_tokens_bucket=16)
    out = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    assert out.tokens.shape == (4, 40) and out.tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    assert np.all(np.asarray(out.mask) == 1) and np.all(np.asarray(out.lengths) == 40)
    assert not np.any(np.asarray(out.stopped_on_eos))


def test_eos_stopping_matches_transformers_generate(hf_model_dir):
    """With EOS ids taken from the greedy rows, HF and we stop every row at the same token and pad after it."""
    config, params = load_hf_model(hf_model_dir("llama"))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=11)
    model = make_hf_model("llama")
    free = hf_generate(model, tokens, mask, 40)
    eos_ids = [int(free[0, 6]), int(free[2, 20])]
    expected = hf_generate(model, tokens, mask, 40, eos_ids=eos_ids)
    greedy = SamplingConfig(max_new_tokens=40, greedy=True, eos_ids=tuple(eos_ids), prompt_bucket=16)
    out = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    lengths = np.asarray(out.lengths)
    assert lengths[0] <= 7 and lengths[2] <= 21 and lengths.min() < 40
    hit = np.isin(expected, eos_ids)
    first_eos = np.where(hit.any(1), hit.argmax(1) + 1, 40)
    np.testing.assert_array_equal(lengths, first_eos)
    np.testing.assert_array_equal(np.asarray(out.stopped_on_eos), hit.any(1))


@requires_shared(STORIES260K)
def test_stories260k_greedy_batch_matches_reference_and_transformers():
    """Three left-padded prompts of lengths 5, 1 and 21: 40 greedy tokens equal run.c's / HF's references."""
    from transformers import AutoModelForCausalLM

    reference = json.loads((STORIES260K / "reference_greedy.json").read_text())
    unprompted = reference["unprompted"]["greedy_new_ids"]
    prompts = [reference["prompt_ids"], [1], [1, *unprompted[:20]]]
    expected = np.array([reference["greedy_new_ids"][:40], unprompted[:40], unprompted[20:60]])
    tokens = np.zeros((3, 21), np.int32)
    mask = np.zeros((3, 21), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, 21 - len(p) :], mask[i, 21 - len(p) :] = p, 1

    config, params = load_hf_model(STORIES260K)
    greedy = SamplingConfig(max_new_tokens=40, greedy=True, eos_ids=(2, 1))
    out = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    hf = AutoModelForCausalLM.from_pretrained(STORIES260K, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_generate(hf, tokens, mask, 40, eos_ids=[2, 1]), expected)


@requires_shared(STORIES260K)
def test_stories260k_unprompted_story_stops_on_bos():
    """run.c's unprompted greedy story: 346 tokens ending with BOS (an EOS id here), then padding."""
    reference = json.loads((STORIES260K / "reference_greedy.json").read_text())["unprompted"]
    config, params = load_hf_model(STORIES260K)
    greedy = SamplingConfig(max_new_tokens=400, greedy=True, eos_ids=(2, 1))
    out = jax.device_get(sample(params, config, np.array([[1]]), np.array([[1]]), jax.random.key(0), greedy))
    expected = reference["greedy_new_ids"]
    assert len(expected) == 346 and out.lengths[0] == 346 and out.stopped_on_eos[0]
    assert out.tokens[0, :346].tolist() == expected
    assert np.all(out.tokens[0, 346:] == PAD) and out.mask[0].sum() == 346


# ----------------------------------------------------------------------------------- sampling distributions

LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0], np.float32)


def _reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The truncated, renormalised distribution, written independently with a sort (transformers' rules)."""
    s = logits.astype(np.float64) / temperature
    keep = np.ones(s.shape, bool)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    if top_k:
        keep &= s >= np.sort(s)[::-1][min(top_k, len(s)) - 1]
    if top_p < 1.0:
        p = softmax(np.where(keep, s, -np.inf))
        order = np.argsort(-s, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep &= s >= s[order[before < top_p][-1]]
    if min_p > 0.0:
        p = softmax(np.where(keep, s, -np.inf))
        keep &= p >= min_p * p.max()
    return softmax(np.where(keep, s, -np.inf))


_sample_jit = jax.jit(
    sample_from_logits, static_argnames=("greedy", "use_top_k", "use_top_p", "use_min_p")
)


@pytest.mark.parametrize(
    "controls",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=4),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05),
    ],
    ids=["temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_sampled_frequencies_match_truncated_distribution(controls):
    """60k draws of one logits vector: chi-square against the renormalised truncated distribution."""
    expected = _reference_distribution(LOGITS, **controls)
    truncating = len(controls) > 1
    if truncating:
        assert 2 <= (expected > 0).sum() < len(LOGITS)  # the case really truncates
    draws = 60_000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (draws, len(LOGITS)))
    flags = dict(use_top_k="top_k" in controls, use_top_p="top_p" in controls, use_min_p="min_p" in controls)
    token, logprob, untruncated = _sample_jit(logits, jax.random.key(42), _knobs(**controls), greedy=False, **flags)
    counts = np.bincount(np.asarray(token), minlength=len(LOGITS))
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a truncated token was sampled"
    p_value = stats.chisquare(counts[kept], draws * expected[kept]).pvalue
    assert p_value > 1e-3, (counts, draws * expected)
    if truncating:  # the test has the power to tell the untruncated distribution apart
        full = _reference_distribution(LOGITS, temperature=controls["temperature"])
        assert stats.chisquare(counts, draws * full).pvalue < 1e-6
    # The returned log-probs are log q(token) and log softmax(s)(token).
    token = np.asarray(token)
    np.testing.assert_allclose(np.asarray(logprob), np.log(expected[token]), atol=1e-5)
    full = _reference_distribution(LOGITS, temperature=controls["temperature"])
    np.testing.assert_allclose(np.asarray(untruncated), np.log(full[token]), atol=1e-5)


def test_truncation_matches_transformers_warpers():
    """Kept sets equal transformers' TopK -> TopP -> MinP warpers on random logits (no ties)."""
    import torch
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = np.random.default_rng(0).normal(size=(64, 50)).astype(np.float32) * 2
    for top_k, top_p, min_p in [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.3), (20, 0.9, 0.02), (0, 0.3, 0.0)]:
        scores = torch.tensor(logits)
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        if min_p:
            scores = MinPLogitsWarper(min_p)(None, scores)
        ours = truncate_logits(
            jnp.asarray(logits), _knobs(top_k=top_k, top_p=top_p, min_p=min_p),
            use_top_k=top_k > 0, use_top_p=top_p < 1, use_min_p=min_p > 0,
        )
        np.testing.assert_array_equal(np.isfinite(np.asarray(ours)), np.isfinite(scores.numpy()))


def test_truncation_edge_cases():
    ties = jnp.array([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])

    def kept(out):
        return np.isfinite(np.asarray(out))[0].tolist()

    # Ties at the k-th value are all kept (as transformers' `scores < kth` test does).
    assert kept(truncate_logits(ties, _knobs(top_k=2), use_top_k=True, use_top_p=False, use_min_p=False)) == [
        True, True, True, True, False, False]
    # top_k >= V keeps everything; a tiny top_p or min_p = 1 keeps only the argmax.
    assert all(kept(truncate_logits(ties, _knobs(top_k=99), use_top_k=True, use_top_p=False, use_min_p=False)))
    assert kept(truncate_logits(ties, _knobs(top_p=1e-6), use_top_k=False, use_top_p=True, use_min_p=False)) == [
        True] + [False] * 5
    assert kept(truncate_logits(ties, _knobs(min_p=1.0), use_top_k=False, use_top_p=False, use_min_p=True)) == [
        True] + [False] * 5
    # Negative, -0.0 and large logits order correctly (bisection works on the float bits).
    mixed = jnp.array([[-0.0, 0.0, -5.0, 1e30, -1e30, 7.5]])
    assert kept(truncate_logits(mixed, _knobs(top_k=2), use_top_k=True, use_top_p=False, use_min_p=False)) == [
        False, False, False, True, False, True]
    # Combined: top-k 4 keeps {3, 2, 2, 2}; top-p 0.5 of that keeps {3} (0.475) plus the tied 2s (0.175 each).
    assert kept(truncate_logits(ties, _knobs(top_k=4, top_p=0.5), use_top_k=True, use_top_p=True,
                                use_min_p=False)) == [True, True, True, True, False, False]


def test_greedy_logprobs_and_argmax_ties():
    logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    token, logprob, untruncated = _sample_jit(logits, jax.random.key(0), _knobs(), greedy=True)
    assert token.tolist() == [1, 0]  # first index on ties, as torch.argmax
    assert np.all(np.asarray(logprob) == 0.0)
    np.testing.assert_allclose(untruncated, jax.nn.log_softmax(logits)[jnp.arange(2), token], atol=1e-6)


# ------------------------------------------------------------------------------------------ log-probs


@pytest.mark.parametrize("truncate", [False, True], ids=["temperature", "top_k_p_min_p"])
def test_logprobs_equal_fresh_forward_pass(truncate, hf_model_dir):
    """The sampler's log-probs equal log_softmax(logits / T) of a fresh forward pass (<= 1e-4), so the
    trainer can use them as the old policy's; with truncation, `logprobs` equals the truncated distribution."""
    config, params = load_hf_model(hf_model_dir("qwen3"))
    tokens, mask = left_padded_batch(config.vocab_size, [4, 9, 6], seed=3)
    controls = dict(top_k=12, top_p=0.9, min_p=0.02) if truncate else {}
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.7, n=2, eos_ids=(5, 7), **controls)
    out = jax.device_get(sample(params, config, tokens, mask, jax.random.key(1), sampling))
    valid = out.mask.astype(bool)
    assert valid.sum() > 40 and (~valid).sum() > 0  # some rows stopped early on an EOS id
    scaled = fresh_logits(params, config, tokens, mask, out, n=2) / 0.7
    untruncated = gather_logprobs(np.asarray(jax.nn.log_softmax(scaled)), out.tokens)
    assert np.abs(out.logprobs_untruncated - untruncated)[valid].max() <= 1e-4
    if truncate:
        knobs = _knobs(temperature=0.7, **controls)
        truncated_logits = truncate_logits(jnp.asarray(scaled), knobs, use_top_k=True, use_top_p=True, use_min_p=True)
        truncated = gather_logprobs(np.asarray(jax.nn.log_softmax(truncated_logits)), out.tokens)
        assert np.abs(out.logprobs - truncated)[valid].max() <= 1e-4
        assert (out.logprobs - out.logprobs_untruncated)[valid].min() > 0  # renormalising raises them
    else:
        assert np.abs(out.logprobs - untruncated)[valid].max() <= 1e-4
    assert np.all(out.logprobs[~valid] == 0) and np.all(out.logprobs_untruncated[~valid] == 0)


def test_greedy_logprobs_equal_fresh_forward_pass(hf_model_dir):
    config, params = load_hf_model(hf_model_dir("mistral"))
    tokens, mask = left_padded_batch(config.vocab_size, [3, 8], seed=4)
    out = jax.device_get(sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(20, greedy=True)))
    logits = fresh_logits(params, config, tokens, mask, out, n=1)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    expected = gather_logprobs(np.asarray(jax.nn.log_softmax(logits)), out.tokens)
    assert np.abs(out.logprobs_untruncated - expected).max() <= 1e-4
    assert np.all(out.logprobs == 0)


def test_unrolled_decode_equals_decoder(hf_model_dir):
    """The sampler's unrolled layer loop over per-layer caches (a prefill, then one token at cache slot 9) computes
    what the training forward computes over the whole sequence."""
    config, params = load_hf_model(hf_model_dir("mistral"))  # sliding window: the allowed mask matters
    tokens, mask = left_padded_batch(config.vocab_size, [10, 6], seed=8)  # the last column is the decoded token
    positions = positions_from_mask(jnp.asarray(mask))
    full = np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))
    unrolled = jax.jit(lambda p, *args: decode_layers(p, split_layers(p, config), config, *args)[:2])
    key_mask = jnp.asarray(mask)
    caches = init_caches(config, 2, 10)
    got, caches = unrolled(params, jnp.asarray(tokens[:, :9]), positions[:, :9], key_mask.at[:, 9].set(0), caches, 0)
    got_next, _ = unrolled(params, jnp.asarray(tokens[:, 9:]), positions[:, 9:], key_mask, caches, 9)
    valid = mask[:, :9] > 0
    np.testing.assert_allclose(np.asarray(got)[valid], full[:, :9][valid], atol=1e-5)
    np.testing.assert_allclose(got_next[:, 0], full[:, 9], atol=1e-5)


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("kind", ["mistral", "qwen3", "llama_linear_rope_bias"])
def test_token_step_equals_decoder(kind, shards, hf_model_dir):
    """The decode loop's token step (head-major caches, fused matmuls) computes what the Flax layers over per-layer
    caches compute (`decode_layers`): sliding window (mistral), q/k norms (qwen3), o/MLP biases
    (llama_linear_rope_bias); also with q|k|v and gate|up fused shard-major for 2 tensor-parallel shards."""
    config, params = load_hf_model(hf_model_dir(kind))
    from jaxrl_llm.models.step_weights import fusable_shards

    assert fusable_shards(config, shards) == shards  # the tiny models divide, so the 2-shard layout is used
    tokens, mask = left_padded_batch(config.vocab_size, [9, 5], seed=8)
    positions = positions_from_mask(jnp.asarray(mask))
    key_mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((2, 1), jnp.int32)], axis=1)
    step = jax.jit(lambda p, *args: decode_layers(p, split_layers(p, config), config, *args)[:2])
    _, cache = step(params, tokens, positions, key_mask, init_caches(config, 2, 10), 0)
    want, want_cache = step(params, tokens[:, :1], positions[:, -1:] + 1, key_mask, cache, 9)
    token_step = jax.jit(lambda p, *args: decode_token(p, step_weights(split_layers(p, config), config, shards),
                                                       config, *args, shards)[:2])
    got, got_caches = token_step(params, jnp.asarray(tokens[:, 0]), positions[:, -1] + 1, key_mask,
                                 loop_caches(cache), 9)
    np.testing.assert_allclose(got, want[:, 0], atol=1e-5)
    for layer_cache, want_layer in zip(got_caches, loop_caches(want_cache), strict=True):
        for name in ("k", "v"):
            np.testing.assert_allclose(layer_cache[name], want_layer[name], atol=1e-5)


# ----------------------------------------------------------------------------- keys, groups, EOS, buckets


def test_same_key_same_tokens_other_key_other_tokens(hf_model_dir):
    config, params = load_hf_model(hf_model_dir("llama"))
    tokens, mask = left_padded_batch(config.vocab_size, [4, 7], seed=2)
    sampling = SamplingConfig(max_new_tokens=16)
    first = sample(params, config, tokens, mask, jax.random.key(7), sampling)
    again = sample(params, config, tokens, mask, jax.random.key(7), sampling)
    other = sample(params, config, tokens, mask, jax.random.fold_in(jax.random.key(7), 1), sampling)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    assert np.mean(np.asarray(first.tokens) != np.asarray(other.tokens)) > 0.5


def test_n_samples_share_one_prefill_and_are_prompt_major(hf_model_dir, monkeypatch):
    config, params = load_hf_model(hf_model_dir("qwen2"))
    tokens, mask = left_padded_batch(config.vocab_size, [4, 7, 2], seed=5)
    prefill_batches = []
    original = sampling_module.prefill

    def recording_prefill(params, layer_params, config, tokens, mask):
        prefill_batches.append(tokens.shape[0])  # at trace time
        return original(params, layer_params, config, tokens, mask)

    monkeypatch.setattr(sampling_module, "prefill", recording_prefill)
    greedy = sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(12, greedy=True, n=3))
    single = sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(12, greedy=True))
    assert prefill_batches == [3, 3]  # B = 3 prompts prefilled, not B * n = 9 rows
    assert greedy.tokens.shape == (9, 12)
    np.testing.assert_array_equal(np.asarray(greedy.tokens).reshape(3, 3, 12), np.repeat(single.tokens, 3, 0).reshape(
        3, 3, 12))
    sampled = np.asarray(sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(12, n=4)).tokens)
    groups = sampled.reshape(3, 4, 12)
    assert all(len({tuple(row) for row in group}) > 1 for group in groups)  # samples of a prompt differ


def test_eos_mask_length_invariants(hf_model_dir):
    """Every row: tokens up to and including the first EOS, then padding; mask, lengths and flags agree."""
    config, params = load_hf_model(hf_model_dir("llama"))
    tokens, mask = left_padded_batch(config.vocab_size, [3, 6, 9, 12] * 4, seed=9)
    eos_ids = tuple(range(1, 20))  # ~1 in 5 tokens
    sampling = SamplingConfig(max_new_tokens=8, eos_ids=eos_ids, pad_id=96, top_k=50)
    out = jax.device_get(sample(params, config, tokens, mask, jax.random.key(3), sampling))
    assert 0 < out.stopped_on_eos.sum() < 16  # both kinds of rows occur
    for row in range(16):
        length = out.lengths[row]
        completion = out.tokens[row]
        is_eos = np.isin(completion[:length], eos_ids)
        assert out.stopped_on_eos[row] == is_eos[-1]
        assert not is_eos[:-1].any()
        assert out.stopped_on_eos[row] or length == 8
        assert np.all(completion[length:] == 96)
        np.testing.assert_array_equal(out.mask[row], np.arange(8) < length)
        assert np.all(out.logprobs[row, length:] == 0) and np.all(out.logprobs[row, :length] < 0)


def test_one_compile_per_bucket(hf_model_dir, monkeypatch):
    """Calls whose prompt length, max_new_tokens and knob values fall into one bucket reuse one program."""
    config, params = load_hf_model(hf_model_dir("llama3_rope"))
    traces = []
    original = sampling_module.prefill

    def counting_prefill(*args):
        traces.append(1)
        return original(*args)

    monkeypatch.setattr(sampling_module, "prefill", counting_prefill)
    programs = compiled_program_count()
    calls = [([3, 5, 2, 1, 4], 5, dict(temperature=1.0, top_k=3)),
             ([16, 1, 9, 9, 2], 16, dict(temperature=0.5, top_k=40)),
             ([7, 7, 7, 7, 7], 9, dict(temperature=1, top_k=1))]
    for i, (lengths, new, controls) in enumerate(calls):
        tokens, mask = left_padded_batch(config.vocab_size, lengths, seed=i)
        sampling = SamplingConfig(new, prompt_bucket=16, new_tokens_bucket=16, **controls)
        out = sample(params, config, tokens, mask, jax.random.key(i), sampling)
        assert out.tokens.shape == (5, new)
    assert len(traces) == 1 and compiled_program_count() == programs + 1
    # A completion length in the next bucket is a new program (the counters do count).
    sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(17, prompt_bucket=16, new_tokens_bucket=16))
    assert len(traces) == 2 and compiled_program_count() == programs + 2


def test_bucket_prompts_trims_and_left_pads():
    tokens = np.array([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    mask = (tokens > 0).astype(np.int32)
    out_tokens, out_mask = bucket_prompts(tokens, mask, SamplingConfig(4, prompt_bucket=4, pad_id=3))
    np.testing.assert_array_equal(out_tokens, [[3, 3, 5, 6], [3, 7, 8, 9]])
    np.testing.assert_array_equal(out_mask, [[0, 0, 1, 1], [0, 1, 1, 1]])


def test_invalid_inputs_are_refused(hf_model_dir):
    config, params = load_hf_model(hf_model_dir("llama"))
    right_padded = np.array([[1, 1, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        sample(params, config, np.array([[4, 5, 0]]), right_padded, jax.random.key(0), SamplingConfig(4))
    with pytest.raises(ValueError, match="at least one token"):
        sample(params, config, np.array([[0, 0], [4, 5]]), np.array([[0, 0], [1, 1]]), jax.random.key(0),
               SamplingConfig(4))
    for bad in (dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=0.0), dict(min_p=1.5), dict(n=0),
                dict(top_k=-1)):
        with pytest.raises(ValueError, match="invalid SamplingConfig"):
            SamplingConfig(**{"max_new_tokens": 4, **bad})
    assert SamplingConfig(4, eos_ids=[3, 4]).eos_ids == (3, 4)  # lists become hashable tuples
    assert SamplingConfig(4, greedy=True, temperature=0.0).greedy  # temperature is ignored when greedy


# ----------------------------------------------------------------------------------------------- CLI


@requires_shared(STORIES260K)
def test_cli_prints_the_greedy_story(capsys):
    from jaxrl_llm.cli.generate import main

    reference = json.loads((STORIES260K / "reference_greedy.json").read_text())
    assert main(["--model", str(STORIES260K), "--prompt", "Once upon a time", "--prompt", "Lily",
                 "--max-new-tokens", "40", "--greedy"]) == 0
    printed = capsys.readouterr().out
    assert reference["greedy_text"].removeprefix("Once upon a time") + "\n" in printed
    assert "prompt 1, sample 0: 40 tokens, stopped on length" in printed
    assert "tokens/s" in printed and "compile" in printed and "paged" in printed  # the rollout engine by default
    # The same story through the static sampler (--engine static).
    assert main(["--model", str(STORIES260K), "--prompt", "Once upon a time", "--prompt", "Lily",
                 "--max-new-tokens", "40", "--greedy", "--engine", "static"]) == 0
    static = capsys.readouterr().out
    assert reference["greedy_text"].removeprefix("Once upon a time") + "\n" in static and "static" in static
    assert [x for x in static.splitlines() if not x.startswith("--- ") or "sample" in x] == \
        [x for x in printed.splitlines() if not x.startswith("--- ") or "sample" in x]


@requires_shared(STORIES260K)
def test_cli_chat_template(tmp_path, capsys):
    """--chat wraps the prompt in the tokenizer's template: the completion continues the templated text."""
    import shutil

    from jaxrl_llm.cli.generate import main

    model_dir = tmp_path / "chat"
    shutil.copytree(STORIES260K, model_dir)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} upon a{% endfor %}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert main(["--model", str(model_dir), "--prompt", "Once", "--chat", "--max-new-tokens", "12", "--greedy"]) == 0
    # "<s>Once upon a" + " time, there was ...": the story's greedy continuation (reference_greedy.json)
    assert " time, there was a little girl" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no chat template"):
        main(["--model", str(STORIES260K), "--prompt", "Once", "--chat", "--max-new-tokens", "4"])


@requires_shared(STORIES260K)
def test_cli_cpu_devices_split_the_batch_and_keep_the_tokens():
    """--cpu-devices 2 (a fresh process: the device count is fixed at start-up) samples the same completions
    as one device for the same seed, with temperature and top-p on; a count that does not divide the prompts
    is a usage error."""
    import os
    import subprocess
    import sys

    from jaxrl_llm.cli.generate import main

    def completions(*extra: str) -> list[str]:
        command = [sys.executable, "-m", "jaxrl_llm", "generate", "--model", str(STORIES260K), "--prompt", "Once",
                   "--prompt", "Lily", "--prompt", "The dog", "--prompt", "Tom", "--max-new-tokens", "24",
                   "--temperature", "0.9", "--top-p", "0.95", "--n", "2", "--seed", "5", *extra]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=True)
        return [line for line in done.stdout.splitlines() if not line.startswith("--- ") or "sample" in line]

    one, split = completions(), completions("--cpu-devices", "2")
    assert len(one) == 16 and split == one
    assert len(set(one[1::2])) > 4  # really sampled: the 8 completions differ
    with pytest.raises(UsageError, match="--cpu-devices 3 must be >= 1 and divide the number of prompts") as usage:
        main(["--model", str(STORIES260K), "--prompt", "a", "--prompt", "b", "--cpu-devices", "3"])
    assert usage.value.exit_code == 2


def test_bfloat16_model_samples_consistently(hf_model_dir):
    """bf16 params and compute (bf16 cache): log-probs stay float32 and agree with a fresh bf16 forward pass
    to bf16 precision (8 mantissa bits on logits of size ~1: a few 1e-3)."""
    config, params = load_hf_model(hf_model_dir("qwen2"), param_dtype="bfloat16", dtype="bfloat16")
    tokens, mask = left_padded_batch(config.vocab_size, [5, 8], seed=6)
    out = jax.device_get(sample(params, config, tokens, mask, jax.random.key(2), SamplingConfig(16, temperature=0.9)))
    assert out.logprobs.dtype == np.float32 and np.all(np.isfinite(out.logprobs)) and np.all(out.logprobs < 0)
    scaled = fresh_logits(params, config, tokens, mask, out, n=1) / 0.9
    fresh = gather_logprobs(np.asarray(jax.nn.log_softmax(scaled)), out.tokens)
    assert np.abs(out.logprobs - fresh).max() <= 0.01
