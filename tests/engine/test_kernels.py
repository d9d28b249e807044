"""The engine's decode attention through its kernels (jaxrl_llm/engine/kernels.py): the Pallas GPU kernel, run in
Pallas' interpreter on this CPU, against the XLA path and a float64 reference; the engine's tokens and log-probs with
it, and with the CPU's C++ kernel, equal to the XLA path's; the decode program lowering for CUDA (Triton) and TPU
(Mosaic) from this machine; the backend each platform and model gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.engine import cpu_kernel, engine_sample
from jaxrl_llm.engine.kernels import attention_backend, paged_decode_attention
from jaxrl_llm.engine.pages import init_pages, page_slots, write_pages
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.sampling import SamplingConfig
from tests.batches import small_engine
from tests.families import left_padded_batch


def _config(**overrides) -> ModelConfig:
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=6, num_kv_heads=2,
                    head_dim=16)
    return ModelConfig(**{**settings, **overrides})


def _reference(q, keys, values, lengths, scale, cap):
    """float64 numpy: each row's heads over its first `lengths[r]` keys `[R, C, KVH, hd]`."""
    rows, heads, _ = q.shape
    group = heads // keys.shape[2]
    out = np.zeros(q.shape)
    for r in range(rows):
        for h in range(heads):
            n = int(lengths[r])
            if n == 0:
                continue
            s = keys[r, :n, h // group] @ q[r, h] * scale
            if cap:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ values[r, :n, h // group]
    return out


@pytest.mark.parametrize("cap", [None, 30.0])
def test_the_gpu_kernel_attends_over_the_pages_as_the_reference(cap):
    """Rows of lengths 0..37 written into shuffled pages: the kernel's output equals a float64 reference over each
    row's own keys (a row of length 0 reads nothing), with and without a soft cap."""
    config = _config(attn_logit_softcap=cap)
    rng = np.random.default_rng(0)
    rows, width, size = 4, 8, 8  # page tables of 8 pages of 8 tokens
    lengths = np.asarray([0, 1, 17, 37])
    table = rng.permutation(40)[: rows * width].reshape(rows, width).astype(np.int32)
    keys, values = (rng.normal(size=(rows, width * size, 2, 16)).astype(np.float32) for _ in range(2))
    pages = init_pages(config, 40, size)[0]
    positions = np.where(np.arange(width * size)[None] < lengths[:, None], np.arange(width * size)[None], -1)
    pages = write_pages(pages, page_slots(jnp.asarray(table), jnp.asarray(positions), size, 40), jnp.asarray(keys),
                        jnp.asarray(values), jnp.float32)
    q = rng.normal(size=(rows, 6, 16)).astype(np.float32)
    out = paged_decode_attention(jnp.asarray(q), pages["k"], pages["v"], jnp.asarray(table), jnp.asarray(lengths),
                                 config, "pallas_interpret")
    expected = _reference(q, keys, values, lengths, config.attention_scale, cap)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)
    assert np.abs(expected[1:]).min() > 0  # the compared rows attend to something


@pytest.mark.parametrize(("kind", "requested", "backend"), [
    ("llama", "pallas", "pallas_interpret"), ("qwen3", "pallas", "pallas_interpret"),
    ("llama", "cpu", "cpu"), ("gemma2", "cpu", "cpu"), ("phi3", "cpu", "cpu")])
def test_the_engine_samples_the_same_with_the_kernel(kind, requested, backend, hf_model_dir):
    """The engine decoding through a kernel (the Pallas GPU kernel interpreted; the CPU's C++ one, with Gemma 2's
    soft caps and alternating sliding windows and Phi-3's window on every layer) gives the XLA path's greedy tokens
    and, sampling at T = 0.8 with EOS on, the same tokens and log-probs (<= 1e-5), page growth and slot refills
    included."""
    if backend == "cpu" and not cpu_kernel.available():
        pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=4)
    for sampling in (SamplingConfig(max_new_tokens=12, greedy=True),
                     SamplingConfig(max_new_tokens=12, temperature=0.8, n=2, eos_ids=(3,))):
        xla = engine_sample(small_engine(config, attention="xla"), params, config, tokens, mask, jax.random.key(2),
                            sampling)
        engine = small_engine(config, attention=requested)
        assert engine.attention == backend
        kernel = engine_sample(engine, params, config, tokens, mask, jax.random.key(2), sampling)
        np.testing.assert_array_equal(kernel.tokens, xla.tokens)
        np.testing.assert_allclose(kernel.logprobs, xla.logprobs, atol=1e-5)
        assert engine.allocator.in_use() == 0 and engine.stats.decode_calls > 2


def test_each_platform_gets_its_kernel_where_it_can_run_the_model():
    """auto: the GPU kernel on GPU, the TPU kernel on TPU only for heads of 128, the C++ kernel on the CPU (sliding
    windows too) where it builds, XLA for sliding windows elsewhere; pallas where the kernel cannot run the model is
    a one-line error naming the setting."""
    plain, wide, windowed = _config(), _config(head_dim=128, num_heads=4), _config(sliding_window=8)
    on_cpu = "cpu" if cpu_kernel.available() else "xla"
    assert [attention_backend(plain, "auto", p) for p in ("cpu", "gpu", "tpu")] == [on_cpu, "pallas_gpu", "xla"]
    assert attention_backend(windowed, "auto", "cpu") == on_cpu
    assert attention_backend(wide, "auto", "tpu") == "pallas_tpu"
    assert attention_backend(windowed, "auto", "gpu") == "xla"
    assert attention_backend(plain, "pallas", "cpu") == "pallas_interpret"
    assert attention_backend(plain, "xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="sampling.engine_attention=pallas: the model has sliding-window layers"):
        attention_backend(windowed, "pallas", "gpu")
    with pytest.raises(ValueError, match="multiple of 128"):
        attention_backend(plain, "pallas", "tpu")


@pytest.mark.parametrize(("platform", "backend", "call"), [("cuda", "pallas_gpu", "__gpu$xla.gpu.triton"),
                                                           ("tpu", "pallas_tpu", "tpu_custom_call")])
def test_the_kernel_decode_program_lowers_for_its_platform(platform, backend, call):
    """The engine's decode program with the kernel exports for CUDA and TPU from this CPU machine (bfloat16), the
    kernel inside the device-side step loop."""
    from jaxrl_llm.engine.programs import SamplingFlags, SlotState, decode_program, prepare_weights
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.sampling.config import knobs_from_config

    config = _config(head_dim=128, num_heads=4, num_kv_heads=2, hidden_size=128, dtype="bfloat16", num_layers=2)
    params = init_params(config, jax.random.key(0))
    weights, pages, slots, width = prepare_weights(params, config), init_pages(config, 32, 16), 4, 8
    state = SlotState(jnp.zeros(slots, jnp.int32), jnp.zeros(slots, jnp.int32), jnp.zeros((slots, width), jnp.int32),
                      jnp.zeros((slots, 2), jnp.uint32), jnp.zeros(slots, jnp.int32), jnp.ones(slots, jnp.int32),
                      jnp.ones(slots, bool))
    flags = SamplingFlags(greedy=False, top_k=False, top_p=True, min_p=False, eos_ids=(1,), pad_id=0)
    exported = jax.export.export(decode_program, platforms=[platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
        params, weights, pages, state, knobs_from_config(SamplingConfig(max_new_tokens=4, top_p=0.9)),
        config=config, flags=flags, steps=4, attention=backend)
    text = exported.mlir_module()
    assert exported.platforms == (platform,) and call in text and "stablehlo.while" in text
