"""The CPU decode-attention kernel (jaxrl_llm/engine/cpu_kernel.py, decode_attention.cc): its output against a
float64 reference (float32 caches) and the XLA path's roundings (bfloat16 caches), over group sizes and head sizes
that take its vectorised and its generic code, soft caps, sliding-window bands and rows that read nothing; the engine's
tokens and log-probs with it equal to the XLA path's; where no compiler is found, a reason and the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import left_padded_batch
from test_engine import small_engine

from jaxrl_llm.engine import cpu_kernel, engine_sample
from jaxrl_llm.engine.kernels import attention_backend
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import loop_layout_attention
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.sampling import SamplingConfig

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason=f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")


def _config(heads: int, kv_heads: int, head_dim: int, cap: float | None = None, dtype: str = "float32"
            ) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, attn_logit_softcap=cap, dtype=dtype)


def _masks(rows: int, context: int, rng: np.random.Generator) -> np.ndarray:
    """`[rows, context]`: a row that reads nothing, prefixes of assorted lengths (under and over 16), one full row
    and sliding-window bands (what `context_allowed` gives local layers)."""
    masks = np.zeros((rows, context), bool)
    for r in range(1, rows):
        kind = r % 3
        if kind == 0:
            masks[r] = True
        elif kind == 1:
            masks[r, : rng.integers(1, context)] = True
        else:
            end = rng.integers(2, context)
            masks[r, max(0, end - rng.integers(1, 12)) : end] = True
    return masks


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, masks: np.ndarray, scale: float,
               cap: float | None) -> np.ndarray:
    """float64: `q [B, H, hd]` over keys `[B, KVH, hd, C]`, values `[B, KVH, C, hd]`, `masks [B, C]` -> `[B, H, hd]`
    (zeros for a row that reads nothing)."""
    rows, heads, hd = q.shape
    group = heads // keys.shape[1]
    out = np.zeros(q.shape)
    for r in range(rows):
        if not masks[r].any():
            continue
        for h in range(heads):
            s = q[r, h].astype(np.float64) @ keys[r, h // group].astype(np.float64) * scale
            if cap:
                s = cap * np.tanh(s / cap)
            s = np.where(masks[r], s, -np.inf)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ values[r, h // group].astype(np.float64)
    return out


def _attend(q, keys, values, masks, config: ModelConfig) -> jax.Array:
    """The kernel's attention alone: every row's position is -1 (no write)."""
    rows, kv_heads, head_dim = keys.shape[0], keys.shape[1], keys.shape[2]
    new = jnp.zeros((rows, kv_heads, head_dim), jnp.asarray(keys).dtype)
    out, k, v = cpu_kernel.decode_attention(jnp.asarray(q), new, new, jnp.full((rows,), -1), jnp.asarray(keys),
                                            jnp.asarray(values), jnp.asarray(masks), config)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(keys))  # nothing written
    return out


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 16),
                                                            (10, 1, 64)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_kernel_equals_a_float64_reference(heads, kv_heads, head_dim, cap):
    """float32 caches of 37 positions (two 16-key blocks and a tail): every row's heads equal the reference (<= 2e-5)
    whatever its mask (prefix, band, full, empty), for the vectorised group sizes and head sizes (1..8 x 32/64/128)
    and the generic path (head size 16, 10 query heads per KV head)."""
    rng = np.random.default_rng(heads * 100 + head_dim)
    config = _config(heads, kv_heads, head_dim, cap)
    rows, context = 7, 37
    q = rng.normal(size=(rows, heads, head_dim)).astype(np.float32)
    keys = rng.normal(size=(rows, kv_heads, head_dim, context)).astype(np.float32)
    values = rng.normal(size=(rows, kv_heads, context, head_dim)).astype(np.float32)
    masks = _masks(rows, context, rng)
    out = _attend(q, keys, values, masks, config)
    expected = _reference(q, keys, values, masks, config.attention_scale, cap)
    np.testing.assert_allclose(np.asarray(out).reshape(q.shape), expected, atol=2e-5)
    assert np.abs(expected[1:]).max(axis=-1).min() > 0.01  # every compared row and head attends to something
    assert not np.asarray(out)[0].any()  # the row that reads nothing gets zeros


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 16)])
def test_under_bfloat16_the_kernel_rounds_as_the_xla_path(heads, kv_heads, head_dim):
    """bfloat16 caches stored as their bits: the kernel's output equals `loop_layout_attention` (bfloat16 operands,
    float32 sums, probabilities rounded to bfloat16) to within a bfloat16 rounding of a probability, and is further
    from the float64 reference of the unrounded query than the XLA path is close to the kernel (the roundings are
    really applied)."""
    rng = np.random.default_rng(1)
    config = _config(heads, kv_heads, head_dim, dtype="bfloat16")
    rows, context = 6, 53
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, head_dim)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(rows, kv_heads, head_dim, context)), jnp.bfloat16)
    values = jnp.asarray(rng.normal(size=(rows, kv_heads, context, head_dim)), jnp.bfloat16)
    masks = _masks(rows, context, rng)
    masks[0] = True  # the XLA path softmaxes an empty row over everything; compare rows that read something
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (keys, values)]
    out = np.asarray(_attend(q, *bits, jnp.asarray(masks)[:, None], config))
    xla = np.asarray(loop_layout_attention(q, keys, values, jnp.asarray(masks)[:, None], config))
    exact = _reference(np.asarray(q)[:, 0], np.asarray(keys, np.float32), np.asarray(values, np.float32), masks,
                       config.attention_scale, None).reshape(out.shape)
    assert np.abs(out - xla).max() <= 8e-3
    assert np.abs(out - exact).max() > 4 * np.abs(out - xla).mean()


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_writes_the_token_where_the_xla_path_does(dtype):
    """`slot_attention` with the kernel: each active row's new key and value land in its cache at its position
    exactly as the XLA path's scatter puts them (bit for bit; an idle row's cache is left as it was), and the
    attention over the updated cache agrees with the XLA path's (float32: <= 2e-5)."""
    from jaxrl_llm.engine.model import layer_inputs, slot_attention
    from jaxrl_llm.engine.pages import storage_dtype

    rng = np.random.default_rng(2)
    config = _config(6, 2, 32, dtype=dtype)
    rows, context, stored = 5, 40, storage_dtype(config.jnp_dtype)

    def cache(shape):
        x = jnp.asarray(rng.normal(size=shape), config.jnp_dtype)
        return jax.lax.bitcast_convert_type(x, stored) if stored == jnp.uint16 else x

    caches = {"k": cache((rows, 2, 32, context)), "v": cache((rows, 2, context, 32))}
    positions = jnp.asarray([0, 17, -1, 39, 5], jnp.int32)
    allowed = layer_inputs(config, positions[:, None], context)[False][2]
    q = jnp.asarray(rng.normal(size=(rows, 1, 6, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, 1, 2, 32)), jnp.float32) for _ in range(2))
    out_x, cache_x = slot_attention(config, dict(caches), positions, allowed, "xla")(q, k, v)
    out_k, cache_k = slot_attention(config, dict(caches), positions, allowed, "cpu")(q, k, v)
    active = np.asarray(positions) >= 0
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(cache_k[name])[active], np.asarray(cache_x[name])[active])
        np.testing.assert_array_equal(np.asarray(cache_k[name])[~active], np.asarray(caches[name])[~active])
        assert not np.array_equal(np.asarray(cache_k[name])[active], np.asarray(caches[name])[active])
    atol = 2e-5 if dtype == "float32" else 8e-3
    np.testing.assert_allclose(np.asarray(out_k)[active], np.asarray(out_x)[active], atol=atol)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "gemma2", "phi3"])
def test_the_engine_samples_the_same_with_the_cpu_kernel(kind, hf_model_dir):
    """The engine decoding through the C++ kernel gives the XLA path's greedy tokens and, sampling at T = 0.8 with
    EOS on, the same tokens and log-probs (<= 1e-5), page growth and slot refills included (Gemma 2: soft caps and
    a sliding window on alternate layers; Phi-3: a window on every layer)."""
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=4)
    for sampling in (SamplingConfig(max_new_tokens=12, greedy=True),
                     SamplingConfig(max_new_tokens=12, temperature=0.8, n=2, eos_ids=(3,))):
        xla = engine_sample(small_engine(config, attention="xla"), params, config, tokens, mask, jax.random.key(2),
                            sampling)
        engine = small_engine(config, attention="cpu")
        assert engine.attention == "cpu"
        kernel = engine_sample(engine, params, config, tokens, mask, jax.random.key(2), sampling)
        np.testing.assert_array_equal(kernel.tokens, xla.tokens)
        np.testing.assert_allclose(kernel.logprobs, xla.logprobs, atol=1e-5)
        assert engine.allocator.in_use() == 0 and engine.stats.decode_calls > 2


def test_without_a_compiler_auto_falls_back_and_cpu_names_why(monkeypatch):
    """No compiler: `auto` decodes on the XLA path, `cpu` is a one-line error naming the setting and the reason; a
    compiler that fails is a one-line reason naming the source file."""
    monkeypatch.setattr(cpu_kernel, "unavailable_reason", lambda: "no C++ compiler found")
    config = _config(4, 2, 16)
    assert attention_backend(config, "auto", "cpu") == "xla"
    with pytest.raises(ConfigError, match="sampling.engine_attention=cpu: no C\\+\\+ compiler found; use auto"):
        attention_backend(config, "cpu", "cpu")
    with pytest.raises(RuntimeError, match="could not build decode_attention.cc") as error:
        cpu_kernel._build("false")  # `false` exits 1 whatever it is given
    assert "\n" not in str(error.value)
