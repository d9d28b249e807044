"""Gated DeltaNet (`models/gated_delta.py`) and the hybrid layer stack it makes (Qwen3.5): the chunked form against
transformers' reference forms and our recurrent one, forward and backward; packed segments; the convolution and its
state; the stack's gradients against torch autograd; packed rows; the static sampler's forked prompt state; the
backward's memory. Logit, export and greedy parity for the family run with every family (tests/families.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.gated_delta import (
    causal_conv,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)

torch = pytest.importorskip("torch")
reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

pytestmark = pytest.mark.quick

B, T, HK, HV, DK, DV = 2, 70, 2, 4, 8, 6


def _inputs(seed: int = 0, t: int = T) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, HK, DK)).astype(np.float32)
    k = rng.normal(size=(B, t, HK, DK)).astype(np.float32)
    v = rng.normal(size=(B, t, HV, DV)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(B, t, HV)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, HV))))).astype(np.float32)
    state = rng.normal(size=(B, HV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def _torch(fn, q, k, v, g, beta, state=None, **kw):
    t = torch.tensor
    out, final = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=None if state is None else t(state),
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out.numpy(), final.numpy()


@pytest.mark.parametrize("chunk", [16, 64, 7])  # 7 divides neither 70 nor a power of two
def test_chunked_form_equals_transformers_chunked_and_recurrent_forms(chunk):
    q, k, v, g, beta, state = _inputs()
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    ref_out, ref_final = _torch(reference.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=chunk)
    rec_out, rec_final = _torch(reference.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    for ours, theirs in ((out, ref_out), (final, ref_final), (out, rec_out), (final, rec_final)):
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-5)
    ours_rec, ours_rec_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(ours_rec), rec_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ours_rec_final), rec_final, atol=2e-5)


def test_packed_segments_start_from_zero_and_never_read_each_other():
    """Row 0 packs sequences [0, 30) and [30, 70); row 1 has 5 padding tokens (segment 0) first. Each sequence's
    outputs equal transformers' run on it alone from a zero state (chunk 16: a boundary inside a chunk), and the
    final state is the last sequence's."""
    q, k, v, g, beta, _ = _inputs(1)
    seg = np.ones((B, T), np.int32)
    seg[0, 30:] = 2
    seg[1, :5] = 0
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, segments=seg, chunk=16)
    rec, rec_final = recurrent_gated_delta_rule(q, k, v, g, beta, segments=seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(rec), atol=2e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(rec_final), atol=2e-5)
    for row, (start, stop) in ((0, (0, 30)), (0, (30, T)), (1, (5, T))):
        part = [a[row:row + 1, start:stop] for a in (q, k, v, g, beta)]
        alone, alone_final = _torch(reference.torch_recurrent_gated_delta_rule, *part)
        np.testing.assert_allclose(np.asarray(out[row, start:stop]), alone[0], atol=2e-5)
        if stop == T:
            np.testing.assert_allclose(np.asarray(final[row]), alone_final[0], atol=2e-5)


def test_chunked_backward_equals_the_recurrent_backward():
    """The chunked form's gradients (its scan rematerialised per chunk) against the token-by-token form's, with
    segments, an initial state and a length that is not a whole number of chunks."""
    q, k, v, g, beta, state = _inputs(2, t=45)
    seg = np.ones((B, 45), np.int32)
    seg[1, 20:] = 2
    rng = np.random.default_rng(3)
    w_out, w_state = rng.normal(size=(B, 45, HV, DV)), rng.normal(size=state.shape)

    def loss(rule, *args):
        out, final = rule(*args, segments=seg) if rule is recurrent_gated_delta_rule else rule(
            *args, segments=seg, chunk=16)
        return jnp.sum(out * w_out) + jnp.sum(final * w_state)

    args = tuple(jnp.asarray(a) for a in (q, k, v, g, beta, state))
    ours = jax.grad(lambda *a: loss(chunked_gated_delta_rule, *a), argnums=tuple(range(6)))(*args)
    ref = jax.grad(lambda *a: loss(recurrent_gated_delta_rule, *a), argnums=tuple(range(6)))(*args)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_causal_conv_matches_torch_and_continues_from_its_state():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, 12, 5)).astype(np.float32)
    w = rng.normal(size=(4, 5)).astype(np.float32)
    ref = reference.causal_conv1d_fn(torch.tensor(x).transpose(1, 2), torch.tensor(w.T), activation="silu")
    out, state = causal_conv(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), ref.transpose(1, 2).numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state), x[:, -3:])
    first, carried = causal_conv(jnp.asarray(x[:, :7]), jnp.asarray(w))
    rest, _ = causal_conv(jnp.asarray(x[:, 7:]), jnp.asarray(w), carried)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), np.asarray(out), atol=1e-6)


def test_the_backward_keeps_one_state_per_chunk_not_per_token():
    """The compiled gradient's temporary memory at 4,096 tokens (Qwen3.5's head size, 128) is a small part of what one
    state per token would take (T * Hv * dk * dv * 4 bytes), and at 2x the tokens it about doubles (linear in the
    context)."""
    def temp_bytes(t: int) -> int:
        shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
                  ((1, t, 2, 128), (1, t, 2, 128), (1, t, 2, 128), (1, t, 2), (1, t, 2))]
        fn = jax.jit(jax.grad(lambda *a: jnp.sum(chunked_gated_delta_rule(*a)[0]), argnums=(0, 1, 2)))
        return fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(4096)
    per_token_states = 4096 * 2 * 128 * 128 * 4
    assert large < per_token_states / 4, (large, per_token_states)  # measured: 76 MB of 537 MB
    assert 1.5 < large / small < 2.5, (small, large)


@pytest.fixture(scope="module")
def qwen3_5(hf_model_dir):
    from jaxrl_llm.models.hf import load_hf_model

    return load_hf_model(hf_model_dir("qwen3_5"))


@pytest.mark.heavy(seconds=20)
def test_gradients_of_every_weight_equal_torch_autograd(qwen3_5):
    """The summed log-likelihood of left-padded rows: our gradient of every parameter, written out in transformers'
    names and layouts (`hf_state_dict`), against torch autograd on the same checkpoint."""
    from jaxrl_llm.models.decoder import forward
    from jaxrl_llm.models.hf_export import hf_state_dict
    from tests.families import left_padded_batch, make_hf_model

    config, params = qwen3_5
    tokens, mask = left_padded_batch(config.vocab_size, [40, 25, 6], seed=7)

    def loglik(p):
        logp = jax.nn.log_softmax(forward(p, config, jnp.asarray(tokens), jnp.asarray(mask)), -1)
        picked = jnp.take_along_axis(logp[:, :-1], jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
        return jnp.sum(picked * mask[:, 1:] * mask[:, :-1])

    grads = dict(hf_state_dict(jax.grad(loglik)(params), config))
    model = make_hf_model("qwen3_5")
    t, m = torch.tensor(tokens), torch.tensor(mask)
    logp = torch.log_softmax(model(input_ids=t, attention_mask=m).logits, -1)
    picked = torch.gather(logp[:, :-1], -1, t[:, 1:, None])[..., 0]
    (picked * m[:, 1:] * m[:, :-1]).sum().backward()
    named = dict(model.named_parameters())
    assert set(grads) == set(named)
    for name, ours in grads.items():
        theirs = named[name].grad.numpy()
        np.testing.assert_allclose(ours, theirs, atol=2e-4 * max(1.0, np.abs(theirs).max()), err_msg=name)


@pytest.mark.heavy(seconds=10)
def test_packed_rows_equal_separate_rows(qwen3_5):
    """Two sequences packed into one row give each the hidden states it has alone: the convolution and the state
    restart at the second one."""
    from jaxrl_llm.models.decoder import forward, forward_packed

    config, params = qwen3_5
    rng = np.random.default_rng(8)
    a, b = rng.integers(0, config.vocab_size, 23), rng.integers(0, config.vocab_size, 30)
    row = jnp.asarray(np.concatenate([a, b, [0, 0]])[None])
    positions = jnp.asarray(np.concatenate([np.arange(23), np.arange(30), [0, 0]])[None])
    segments = jnp.asarray(np.concatenate([np.ones(23), 2 * np.ones(30), [0, 0]])[None].astype(np.int32))
    packed = np.asarray(forward_packed(params, config, row, positions, segments))[0]
    for seq, start in ((a, 0), (b, 23)):
        alone = np.asarray(forward(params, config, jnp.asarray(seq[None]), jnp.ones((1, len(seq)), jnp.int32),
                                   return_hidden=True))[0]
        np.testing.assert_allclose(packed[start:start + len(seq)], alone, atol=1e-5)


@pytest.mark.heavy(seconds=10)
def test_samples_forked_from_one_prefilled_state_equal_separate_prefills(qwen3_5):
    """`n = 3` greedy samples per prompt start from one prefill's end state (copied to each): the same tokens as
    three copies of the prompt each prefilled on its own (`n = 1`)."""
    from jaxrl_llm.sampling import sample
    from jaxrl_llm.sampling.config import SamplingConfig

    config, params = qwen3_5
    tokens = np.array([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
    mask = (np.arange(7) >= np.array([[2], [0]])).astype(np.int32)
    forked = sample(params, config, tokens, mask, jax.random.key(0),
                    SamplingConfig(max_new_tokens=10, greedy=True, eos_ids=(), n=3))
    separate = sample(params, config, np.repeat(tokens, 3, 0), np.repeat(mask, 3, 0), jax.random.key(0),
                      SamplingConfig(max_new_tokens=10, greedy=True, eos_ids=(), n=1))
    np.testing.assert_array_equal(np.asarray(forked.tokens), np.asarray(separate.tokens))
    np.testing.assert_allclose(np.asarray(forked.logprobs_untruncated), np.asarray(separate.logprobs_untruncated),
                               atol=1e-5)


def test_the_paged_engine_hands_a_hybrid_stack_to_the_static_sampler_and_says_why():
    from jaxrl_llm.engine import make_sampler
    from jaxrl_llm.models.config import LinearAttention, ModelConfig
    from jaxrl_llm.sampling import StaticSampler

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=4, layer_types=("linear_attention", "full_attention"),
                         linear=LinearAttention(1, 2, 4, 4))
    sampler = make_sampler("paged", config)
    assert isinstance(sampler, StaticSampler)
    assert "linear-attention" in sampler.describe(None)  # type: ignore[arg-type]


@pytest.mark.heavy(seconds=10)
def test_lora_reaches_the_linear_layers_and_exports_under_their_layer_indices(qwen3_5):
    """Adapters on the Gated DeltaNet projections (`lora.targets` by transformers' names): the merged model's logits
    equal the unmerged forward's, and PEFT's tensors are named for the linear layers (0-2, 4-6), not for all eight."""
    from jaxrl_llm.models.decoder import forward
    from jaxrl_llm.models.lora import LoraSpec, init_adapters, insert_adapters, merge_adapters, peft_tensors

    config, params = qwen3_5
    spec = LoraSpec(rank=2, alpha=4.0, targets=r"in_proj_(qkv|z)|out_proj")
    adapters = init_adapters(params, spec, jax.random.key(0))
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # B = 0 at init: move it so the update shows
    tokens, mask = jnp.asarray([[3, 4, 5, 6, 7, 8]]), jnp.ones((1, 6), jnp.int32)
    merged = forward(merge_adapters(params, adapters, spec.scale), config, tokens, mask)
    unmerged = forward(insert_adapters(params, adapters), config.replace(lora_scale=spec.scale), tokens, mask)
    base = forward(params, config, tokens, mask)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), atol=1e-5)
    assert float(jnp.abs(merged - base).max()) > 1e-3
    names = {name.split(".")[4] for name, _ in peft_tensors(adapters, config)}
    assert names == {str(i) for i in config.layers_holding("linear_attn")}


def test_a_sequences_linear_state_has_the_planners_size_at_any_length():
    """The static sampler's per-layer caches at 16 and 4,096 slots: the softmax layer's keys and values grow with the
    length, the linear layers' states do not, and their bytes are what the planner counts per sequence."""
    from jaxrl_llm.memory_plan.plan import linear_state_bytes
    from jaxrl_llm.models.config import LinearAttention, ModelConfig
    from jaxrl_llm.models.decode import init_caches

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=4, num_heads=2,
                         num_kv_heads=1, head_dim=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
                         linear=LinearAttention(2, 4, 8, 6))

    def state_and_kv_bytes(length: int) -> tuple[int, int]:
        caches = init_caches(config, 1, length)
        state = sum(a.nbytes for i, c in enumerate(caches) if config.is_linear(i) for a in jax.tree.leaves(c))
        return state, sum(a.nbytes for a in jax.tree.leaves(caches[3]))

    (short_state, short_kv), (long_state, long_kv) = state_and_kv_bytes(16), state_and_kv_bytes(4096)
    # per linear layer: the window, 3 x (2 * 16 + 24) float32, and the 4 x 8 x 6 float32 state
    assert short_state == long_state == linear_state_bytes(config) == 3 * (3 * 56 * 4 + 4 * 4 * 8 * 6)
    assert long_kv == 256 * short_kv


@pytest.mark.heavy(seconds=10)
def test_the_text_part_of_a_multimodal_qwen3_5_checkpoint_loads(tmp_path):
    """A `Qwen3_5ForConditionalGeneration` directory (config.json's `text_config`, the decoder under
    `model.language_model.`, a vision tower, and a multi-token-prediction tensor as released checkpoints carry):
    its text part loads as `qwen3_5_text`, the vision tower and the MTP head left out as transformers' causal-LM
    class leaves them, and its logits on text are the multimodal model's."""
    from safetensors.numpy import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from jaxrl_llm.models.decoder import forward
    from jaxrl_llm.models.hf import load_hf_model

    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=6)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    model.save_pretrained(tmp_path)
    save_file({"mtp.fc.weight": np.ones((32, 64), np.float32)}, tmp_path / "mtp.safetensors", {"format": "pt"})
    config, params = load_hf_model(tmp_path)
    assert config.model_type == "qwen3_5_text" and config.is_hybrid
    tokens = np.random.default_rng(0).integers(0, 64, (2, 20))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), attention_mask=torch.ones(2, 20, dtype=torch.long)).logits
    ours = forward(params, config, jnp.asarray(tokens), jnp.ones((2, 20), jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), ref.numpy(), atol=1e-5)


def test_the_run_header_names_the_linear_layers_path():
    """The header's training-attention clause names the linear layers' path beside the softmax layers'."""
    from jaxrl_llm.models.attention import describe
    from jaxrl_llm.models.block import training_attention
    from jaxrl_llm.models.config import LinearAttention, ModelConfig

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=4, layer_types=("linear_attention", "full_attention"),
                         linear=LinearAttention(1, 2, 4, 4), attention="xla")
    text = describe(training_attention(config, "cpu"))
    assert text == "global XLA (chunked); linear XLA (chunked, the gated delta rule in chunks of 64, no kernel yet)"
