"""The CPU paged decode-attention kernel (jaxrl_llm/engine/cpu_kernel.py, decode_attention.cc): its output through
shuffled page tables against a float64 reference (float32 pool) and the XLA path's roundings (bfloat16 pool), over
group sizes and head sizes that take its vectorised and its generic code, page sizes, soft caps, sliding windows and
rows that read nothing; where no compiler is found, a reason and the XLA path (the engine's tokens through it:
tests/engine/test_kernels.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.engine import cpu_kernel
from jaxrl_llm.engine.kernels import attention_backend
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import loop_layout_attention
from tests.runs import ROOT

pytestmark = pytest.mark.heavy(seconds=41)

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(),
                                  reason=f"the CPU kernel cannot be built here: {cpu_kernel.unavailable_reason()}")


def _config(heads: int, kv_heads: int, head_dim: int, cap: float | None = None, dtype: str = "float32"
            ) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, attn_logit_softcap=cap, dtype=dtype)


def _pool(rows: int, lengths: np.ndarray, kv_heads: int, head_dim: int, page_size: int, dtype, rng):
    """A pool `[KVH, N, page_size, hd]` of random keys and values and page tables `[rows, M]` of shuffled pages
    (a row's pages scattered through the pool; rows 2 and 3 share their first page, as a group's samples share
    their prompt's); also each row's keys and values in position order `[rows, KVH, M * page_size, hd]`."""
    width = max(1, -(-int(lengths.max()) // page_size))
    pages = rows * width + 1
    table = rng.permutation(pages)[: rows * width].reshape(rows, width).astype(np.int32)
    table[3, 0] = table[2, 0]
    k, v = (jnp.asarray(rng.normal(size=(kv_heads, pages, page_size, head_dim)), dtype) for _ in range(2))
    ordered = [np.asarray(x.astype(jnp.float32))[:, table].transpose(1, 0, 2, 3, 4).reshape(rows, kv_heads, -1,
                                                                                          head_dim) for x in (k, v)]
    return k, v, table, *ordered


def _stored(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, lengths: np.ndarray, window: int | None,
               scale: float, cap: float | None) -> np.ndarray:
    """float64: `q [S, H, hd]` over each row's keys and values `[S, KVH, C, hd]` in position order, positions
    `max(0, length - window) .. length - 1` -> `[S, H, hd]` (zeros for a row of length 0)."""
    rows, heads, hd = q.shape
    group = heads // keys.shape[1]
    out = np.zeros(q.shape)
    for r in range(rows):
        n = int(lengths[r])
        lo = max(0, n - window) if window else 0
        if n == 0:
            continue
        for h in range(heads):
            s = keys[r, h // group, lo:n].astype(np.float64) @ q[r, h].astype(np.float64) * scale
            if cap:
                s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ values[r, h // group, lo:n].astype(np.float64)
    return out


LENGTHS = np.asarray([0, 1, 15, 16, 17, 37, 64])  # empty, within a page, page edges, a tail past 16-key blocks


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 16),
                                                            (10, 1, 64)])
@pytest.mark.parametrize(("cap", "window", "page_size"), [(None, None, 16), (2.0, None, 8), (None, 5, 4)])
def test_the_kernel_equals_a_float64_reference(heads, kv_heads, head_dim, cap, window, page_size):
    """A float32 pool read through shuffled page tables: every row's heads equal the reference (<= 2e-5) over its
    own positions (lengths 0..64, the last `window` under a sliding window), for the vectorised group and head sizes
    (1..8 x 32/64/128) and the generic path (head size 16, 10 query heads per KV head), with a soft cap, and for
    pages of 16, 8 and 4."""
    rng = np.random.default_rng(heads * 100 + head_dim)
    config = _config(heads, kv_heads, head_dim, cap)
    k, v, table, keys, values = _pool(len(LENGTHS), LENGTHS, kv_heads, head_dim, page_size, jnp.float32, rng)
    q = rng.normal(size=(len(LENGTHS), heads, head_dim)).astype(np.float32)
    out = cpu_kernel.paged_decode_attention(jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(LENGTHS), window,
                                            config)
    expected = _reference(q, keys, values, LENGTHS, window, config.attention_scale, cap)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)
    assert np.abs(expected[1:]).max(axis=-1).min() > 0.01  # every compared row and head attends to something
    assert not np.asarray(out)[0].any()  # the row that reads nothing gets zeros


# On a CPU with AVX512-BF16 the bfloat16 pool goes through VDPBF16PS; the portable build is what other CPUs run.
BUILDS = [pytest.param(cpu_kernel.ATTENTION, id="native"),
          pytest.param(cpu_kernel.PORTABLE_ATTENTION, id="portable", marks=pytest.mark.skipif(
              not cpu_kernel.has_avx512_bf16(), reason="the native build is the portable one on this CPU"))]


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "cap", "window", "page_size"),
                         [(9, 3, 64, None, None, 16), (4, 4, 32, None, 5, 4), (8, 2, 128, 2.0, None, 8),
                          (16, 2, 64, None, 17, 64), (6, 2, 16, None, None, 16)])
def test_under_bfloat16_the_kernel_rounds_as_the_xla_path(build, heads, kv_heads, head_dim, cap, window, page_size):
    """A bfloat16 pool stored as its bits: the kernel's output equals the engine's XLA path over the same rows
    (`loop_layout_attention` on contiguous caches: bfloat16 operands, float32 sums, probabilities rounded to
    bfloat16) to within a bfloat16 rounding of a probability, and is further from the float64 reference of the
    unrounded query than that (the roundings are really applied): head sizes 32/64/128 and the generic 16, odd
    and even numbers of positions from unaligned starts (windows of 5 and 17), a soft cap, pages of 4 to 64 (every
    pool position no row reads is NaN, so a read past a row's positions shows), in the build this CPU runs and,
    where that one uses AVX512-BF16, the portable build too."""
    rng = np.random.default_rng(heads + head_dim)
    config = _config(heads, kv_heads, head_dim, cap, dtype="bfloat16")
    lengths = np.asarray([1, 15, 16, 17, 37, 64, 90])  # the XLA path softmaxes an empty row over everything
    k, v, table, keys, values = _pool(len(lengths), lengths, kv_heads, head_dim, page_size, jnp.bfloat16, rng)
    read = np.zeros(k.shape[1:3], bool)  # [N, page_size]: the pool positions some row reads
    for row, length in enumerate(lengths):
        p = np.arange(max(0, length - window) if window else 0, length)
        read[table[row, p // page_size], p % page_size] = True
    k, v = (jnp.where(read[None, :, :, None], x, jnp.nan) for x in (k, v))  # a read past a row's positions is NaN
    q = jnp.asarray(rng.normal(size=(len(lengths), heads, head_dim)), jnp.float32)
    out = np.asarray(cpu_kernel.paged_decode_attention(q, _stored(k), _stored(v), jnp.asarray(table),
                                                       jnp.asarray(lengths), window, config, kernel=build))
    positions = np.arange(keys.shape[2])[None, None, :]
    allowed = (positions < lengths[:, None, None]) & (positions >= lengths[:, None, None] - (window or 10**9))
    xla = np.asarray(loop_layout_attention(q[:, None], jnp.asarray(keys, jnp.bfloat16).swapaxes(2, 3),
                                           jnp.asarray(values, jnp.bfloat16), jnp.asarray(allowed), config)
                     ).reshape(out.shape)
    exact = _reference(np.asarray(q), keys, values, lengths, window, config.attention_scale, cap)
    assert np.abs(out - xla).max() <= 8e-3
    assert np.abs(out - exact).max() > 4 * np.abs(out - xla).mean()


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


NO_AMX = cpu_kernel.packed_matmul_unavailable_reason()
needs_amx = pytest.mark.skipif(NO_AMX is not None, reason=f"the AMX matmul cannot run here: {NO_AMX}")


def test_packing_is_a_permutation_into_amx_tiles():
    """`pack_weight`: tile (nb, kb), row p, column 2n + e holds w[32 kb + 2 p + e, 16 nb + n]; K padded with zeros."""
    w = jnp.arange(40 * 32, dtype=jnp.float32).reshape(40, 32) % 251  # exact in bfloat16
    packed = np.asarray(cpu_kernel.pack_weight(w).astype(jnp.float32))
    assert packed.shape == (2, 2, 16, 32)
    for nb, kb, p, n, e in [(0, 0, 0, 0, 0), (1, 0, 3, 5, 1), (0, 1, 3, 15, 1), (1, 1, 0, 7, 0)]:
        assert packed[nb, kb, p, 2 * n + e] == float(w[32 * kb + 2 * p + e, 16 * nb + n])
    assert not packed[:, 1, 4:].any()  # rows 40.. of K are padding
    assert sorted(packed[packed != 0]) == sorted(np.asarray(w)[np.asarray(w) != 0])  # every weight, once
    assert cpu_kernel.packable(w) and not cpu_kernel.packable(w[:, :24])
    assert cpu_kernel.pack_weight(w[:, :24]).shape == (2, 2, 16, 32)  # N padded to whole tiles


@needs_amx
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 16), (5, 40, 48), (16, 576, 960), (33, 96, 80), (128, 64, 32),
                                           (3, 64, 37)])
def test_the_packed_matmul_equals_the_bfloat16_dot(m, k, n):
    """`packed_matmul(x, pack_weight(w))` is `x @ w` over bfloat16 operands with float32 sums: against float64
    over the rounded operands (<= 1e-6 relative to the terms' size) and XLA's dot (<= 1e-5), for rows that are not a
    multiple of 16, K that is not a multiple of 32, an odd number of column tiles and N padded to whole tiles."""
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu_kernel.packed_matmul(x, cpu_kernel.pack_weight(w), n))(x, w))
    xb, wb = (np.asarray(a.astype(jnp.bfloat16), np.float64) for a in (x, w))
    assert got.shape == (m, n) and got.dtype == np.float32
    size = np.max(np.abs(xb) @ np.abs(wb))
    np.testing.assert_allclose(got, xb @ wb, rtol=0, atol=1e-6 * size)
    xla = np.asarray(jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32))
    np.testing.assert_allclose(got, xla, rtol=0, atol=1e-5 * size)
    assert np.abs(got - np.asarray(x) @ np.asarray(w)).max() > 1e-4  # the operands were rounded to bfloat16


@needs_amx
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize(("m", "k", "n"), [(37, 576, 48), (3, 40, 16)])
def test_the_matmul_applies_the_blocks_rms_norm_to_its_float32_rows(unit_offset, m, k, n):
    """`packed_matmul(x, w, norm=Norm(scale, eps, unit_offset))` over float32 rows is `rms_norm(x) @ w`: against
    float64 (the norm exact, then `@ w` over bfloat16 weights) within the rounding of the normalized rows to
    bfloat16, and against XLA's `rms_norm` then the kernel within a few roundings' flips; the gated kernel takes the
    same norm; a float32 x without a norm is only rounded."""
    from jaxrl_llm.models.layers import rms_norm

    rng = np.random.default_rng(m + k + unit_offset)
    x = jnp.asarray(rng.normal(size=(m, k)) * rng.uniform(0.1, 30, size=(m, 1)), jnp.float32)  # rows' scales differ
    scale = jnp.asarray(rng.normal(size=(k,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, 2 * n)), jnp.float32)
    norm = cpu_kernel.Norm(scale, 1e-5, unit_offset)
    got = np.asarray(jax.jit(lambda x: cpu_kernel.packed_matmul(x, cpu_kernel.pack_weight(w), norm=norm))(x))
    x64, s64 = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    normed = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * (1 + s64 if unit_offset else s64)
    wb = np.asarray(w.astype(jnp.bfloat16), np.float64)
    size = np.abs(normed) @ np.abs(wb)
    assert np.all(np.abs(got - normed @ wb) <= 2 ** -8 * size + 1e-6)
    xla = np.asarray(cpu_kernel.packed_matmul(rms_norm(x, scale, 1e-5, unit_offset=unit_offset),
                                              cpu_kernel.pack_weight(w)))
    assert np.all(np.abs(got - xla) <= 2 ** -7 * size.max(-1, keepdims=True) * 4 / np.sqrt(k) + 1e-6)
    assert (got == xla).mean() > 0.5  # most rows round every element as XLA does
    gated = cpu_kernel.packed_gated_matmul(x, cpu_kernel.pack_gated_weight(w), "silu", norm=norm)
    unfused = cpu_kernel.packed_gated_matmul(rms_norm(x, scale, 1e-5, unit_offset=unit_offset),
                                             cpu_kernel.pack_gated_weight(w), "silu")
    assert (np.asarray(gated, np.float32) == np.asarray(unfused, np.float32)).mean() > 0.5
    plain = cpu_kernel.packed_matmul(x, cpu_kernel.pack_weight(w))
    np.testing.assert_array_equal(plain, cpu_kernel.packed_matmul(x.astype(jnp.bfloat16), cpu_kernel.pack_weight(w)))


def test_gated_packing_interleaves_the_gate_and_up_blocks():
    """`pack_gated_weight(gate|up)`: column block 2j is the gate's columns 16j.., block 2j + 1 the up projection's."""
    w = jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64) % 253  # gate: columns 0..31, up: 32..63
    packed, plain = (np.asarray(a.astype(jnp.float32)) for a in (cpu_kernel.pack_gated_weight(w),
                                                                  cpu_kernel.pack_weight(w)))
    np.testing.assert_array_equal(packed[[0, 1, 2, 3]], plain[[0, 2, 1, 3]])


@needs_amx
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("m", "k", "i"), [(1, 64, 16), (5, 40, 48), (37, 576, 1536)])
def test_the_gated_matmul_equals_xlas_activation_of_the_product(act, m, k, i):
    """`packed_gated_matmul(x, pack_gated_weight(gate|up), act)` is `act(g) * u` of the float32 product rounded to
    bfloat16: against float64 over the kernel's own product within bfloat16's rounding, also where the gate is far
    out in either tail; and the engine's XLA path (`gated_activation`, then the down projection's cast) in nearly
    every element: for silu within one bfloat16 step (the exponentials differ in their last float32 bits); XLA's
    tanh form of GeLU loses the far negative tail to `1 + tanh(a)` cancelling (0 below a ~ -9, where the kernel's
    `g sigmoid(2a)` keeps ~1e-28), so there only the bulk is compared."""
    from jaxrl_llm.models.layers import gated_activation

    rng = np.random.default_rng(m + k + i)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = rng.normal(size=(k, 2 * i)) / np.sqrt(k)
    w[:, :4] *= 200.0  # gates of hundreds, both signs: exp(-|z|) underflows, act(g) = g or 0
    w = jnp.asarray(w, jnp.float32)
    got = jax.jit(lambda x, w: cpu_kernel.packed_gated_matmul(x, cpu_kernel.pack_gated_weight(w), act))(x, w)
    assert got.shape == (m, i) and got.dtype == jnp.bfloat16
    product = cpu_kernel.packed_matmul(x, cpu_kernel.pack_weight(w))
    xla = gated_activation(product[:, :i], product[:, i:], act).astype(jnp.bfloat16)
    bits = (np.asarray(a).view(np.int16).astype(np.int32) for a in (got, xla))
    steps = np.abs(next(bits) - next(bits))  # bfloat16 steps apart (same signs; +0 and -0 are equal)
    steps[np.asarray(got, np.float32) == np.asarray(xla, np.float32)] = 0
    assert (steps == 0).mean() > 0.99
    if act == "silu":
        assert steps.max() <= 1
    g, u = (np.asarray(a, np.float64) for a in (product[:, :i], product[:, i:]))
    # g sigmoid(z): z = g, or z = 2a for the tanh GeLU (0.5 (1 + tanh a) = sigmoid(2a), whose tail float64's
    # tanh would round away too)
    z = g if act == "silu" else 2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)
    with np.errstate(over="ignore"):
        reference = g / (1 + np.exp(-z)) * u
    np.testing.assert_allclose(np.asarray(got, np.float64), reference, rtol=2 ** -8, atol=1e-30)
    assert np.isfinite(np.asarray(got, np.float32)).all() and np.abs(g).max() > 50


def test_without_amx_the_engine_keeps_xla_matmuls(monkeypatch):
    """No AMX (another CPU, or Linux refusing the tiles): a one-line reason, and the engine decodes with XLA's
    matmuls; a float32 model or the XLA path never packs."""
    from tests.batches import small_engine

    monkeypatch.setattr(cpu_kernel, "_has_amx", lambda: False)
    assert cpu_kernel._load.__wrapped__(cpu_kernel.MATMUL) == "this CPU has no AMX (amx_bf16)"
    monkeypatch.setattr(cpu_kernel, "packed_matmul_unavailable_reason", lambda: "this CPU has no AMX (amx_bf16)")
    bf16 = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=16, dtype="bfloat16")
    assert not small_engine(bf16).packed_matmul
    monkeypatch.undo()
    assert not small_engine(bf16, attention="xla").packed_matmul
    assert not small_engine(_config(4, 2, 16)).packed_matmul


@needs_amx
@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_the_engine_samples_the_same_with_the_packed_matmul(kind, hf_model_dir):
    """A bfloat16 model decoding on the AMX matmul (Gemma 2: its final logits soft-capped after the packed head)
    gives the tokens and log-probs of the same engine on XLA's matmuls, greedy and sampled; the decode program
    calls the kernel."""
    from jaxrl_llm.engine import engine_sample
    from jaxrl_llm.engine.model import kernel_decode_step
    from jaxrl_llm.engine.pages import init_pages
    from jaxrl_llm.engine.programs import pack_weights, prepare_weights
    from jaxrl_llm.models.hf import load_hf_model
    from jaxrl_llm.sampling import SamplingConfig
    from tests.batches import small_engine
    from tests.families import left_padded_batch

    config, params = load_hf_model(hf_model_dir(kind), dtype="bfloat16")
    tokens, mask = left_padded_batch(config.vocab_size, [5, 12, 1, 9], seed=4)
    for sampling in (SamplingConfig(max_new_tokens=12, greedy=True),
                     SamplingConfig(max_new_tokens=12, temperature=0.8, n=2, eos_ids=(3,))):
        plain = small_engine(config)
        plain.packed_matmul = False
        expected = engine_sample(plain, params, config, tokens, mask, jax.random.key(2), sampling)
        engine = small_engine(config)
        assert engine.packed_matmul
        got = engine_sample(engine, params, config, tokens, mask, jax.random.key(2), sampling)
        np.testing.assert_array_equal(got.tokens, expected.tokens)
        np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=1e-4)
        assert engine.allocator.in_use() == 0 and engine.stats.decode_calls > 2
    weights = prepare_weights(params, config)
    packed = pack_weights(params, weights, config=config)
    assert all(m.ndim == 4 for w in packed.layers for m in (w.qkv, w.o, w.gate_up, w.down))
    assert packed.head.shape[0] * 16 >= config.vocab_size
    lowered = jax.jit(kernel_decode_step, static_argnames=("config", "backend")).lower(
        params, packed, config=config, tokens=jnp.zeros(4, jnp.int32), positions=jnp.zeros(4, jnp.int32),
        page_table=jnp.zeros((4, 2), jnp.int32), pages=init_pages(config, 8, 4), backend="cpu")
    text, logits = lowered.as_text(), lowered.out_info[0]
    assert text.count(cpu_kernel.MATMUL.target) == 4 * config.num_layers + 1 and logits.shape == (4, config.vocab_size)
    gated = cpu_kernel.GATED_ACTIVATIONS[config.hidden_act]  # act(gate) * up in the kernel: one call per layer
    assert text.count(f"activation = {gated} : i64") == config.num_layers


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_a_prefill_chunk_attends_through_the_kernel_as_through_xla(kind, hf_model_dir):
    """`prefill_program(attention="cpu")`: each query of the chunk a kernel row over its own sequence's pages (the
    earlier chunk's included; Phi-3's sliding window) gives XLA's logits (float32, <= 1e-5) and writes the same
    keys into the pages (<= 1e-5); padding queries write nothing (pages outside the tables stay zero)."""
    from jaxrl_llm.engine.pages import init_pages
    from jaxrl_llm.engine.programs import prefill_program, prepare_weights
    from jaxrl_llm.models.hf import load_hf_model

    config, params = load_hf_model(hf_model_dir(kind))
    weights, rng = prepare_weights(params, config), np.random.default_rng(3)
    table = jnp.asarray(rng.permutation(24)[:16].reshape(4, 4), jnp.int32)  # 4 rows of 4 pages of 4
    tokens = jnp.asarray(rng.integers(1, config.vocab_size, (4, 8)), jnp.int32)
    results = {}
    for attention in ("xla", "cpu"):
        pages = init_pages(config, 24, 4)
        first = jnp.asarray(np.where(np.arange(8)[None] < np.array([[8], [5], [8], [1]]), np.arange(8)[None], -1),
                            jnp.int32)
        _, pages, _ = prefill_program(params, weights, pages, tokens, first, table, jnp.zeros(4, jnp.int32),
                                      config=config, attention=attention)
        second = jnp.where(first >= 0, first + 8, -1)  # the next chunk reads the first one's pages
        logits, pages, _ = prefill_program(params, weights, pages, tokens[:, ::-1], second, table,
                                           jnp.asarray([7, 4, 7, 0], jnp.int32), config=config, attention=attention)
        results[attention] = (np.asarray(logits), [np.asarray(layer["k"]) for layer in pages])
    np.testing.assert_allclose(results["cpu"][0], results["xla"][0], atol=1e-5)
    unused = np.setdiff1d(np.arange(24), np.asarray(table))
    for got, expected in zip(results["cpu"][1], results["xla"][1], strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)  # later layers' keys: earlier layers' attention
        assert not got[:, unused].any() and np.abs(got).max() > 0


NO_SAMPLING = cpu_kernel.sampling_unavailable_reason()
needs_sampling = pytest.mark.skipif(NO_SAMPLING is not None, reason=f"the sampling kernel cannot run: {NO_SAMPLING}")


@needs_sampling
@pytest.mark.parametrize(("vocab", "temperature"), [(49152, 1.0), (1000, 0.6), (5, 1.3)])
def test_the_sampling_kernel_draws_each_rows_inverse_cdf(vocab, temperature):
    """`cpu_kernel.inverse_cdf_sample` against float64: each row's token is the entry whose cumulative interval of
    `exp(s - max s)` (`s = logits / T`) holds `u * total` (to float32 rounding of the sums, 1e-5 of the total), its
    log-probability is `log softmax(s)` there (<= 2e-5), entries with a -inf logit are never drawn (also at u near
    1), and the tokens are `sample_with_uniform`'s (XLA's) but where the target lies within rounding of an edge.
    Vocabularies over several blocks with a partial last one (1000: blocks of 32), and below one block (5)."""
    from jaxrl_llm.sampling.config import Knobs
    from jaxrl_llm.sampling.logits import sample_with_uniform

    rng = np.random.default_rng(vocab)
    rows = 96
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    logits[: rows // 2, ::3] = -np.inf  # a third of the vocabulary impossible in half the rows
    logits[:, 1] = -np.inf if vocab > 2 else logits[:, 1]
    uniform = rng.random(rows).astype(np.float32)
    uniform[:4] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5, 1e-7]
    token, logprob = (np.asarray(x) for x in cpu_kernel.inverse_cdf_sample(jnp.asarray(logits), jnp.asarray(uniform),
                                                                             np.float32(temperature)))
    s = logits.astype(np.float64) / np.float32(temperature)
    w = np.exp(s - s.max(-1, keepdims=True))
    cumulative = np.cumsum(w, -1)
    total = cumulative[:, -1]
    target = uniform * total
    picked = np.arange(rows), token
    below = np.where(token > 0, cumulative[np.arange(rows), np.maximum(token - 1, 0)], 0.0)
    assert np.all(below <= target + 1e-5 * total) and np.all(target <= cumulative[picked] + 1e-5 * total)
    assert np.all(np.isfinite(logits[picked]))  # never an impossible entry
    np.testing.assert_allclose(logprob, s[picked] - s.max(-1) - np.log(total), atol=2e-5)
    knobs = Knobs(np.float32(temperature), np.int32(0), np.float32(1.0), np.float32(0.0), np.int32(0))
    xla = np.asarray(sample_with_uniform(jnp.asarray(logits), jnp.asarray(uniform), knobs, greedy=False)[0])
    edge = np.minimum(np.abs(target - below), np.abs(cumulative[picked] - target)) < 1e-5 * total
    assert np.all((token == xla) | edge) and (token == xla).mean() > 0.9


def test_a_run_whose_kernel_build_fails_says_why_in_its_header_and_trains(tmp_path):
    """`python train.py --algo grpo` with a compiler that fails: the header names the sampler's paths, attention on
    XLA with the compiler's first error line as the reason, and the run still trains to its end."""
    import os
    import subprocess
    import sys

    broken = tmp_path / "broken-c++"
    broken.write_text('#!/bin/sh\necho "kernel.cc:1:1: error: this compiler is broken on purpose" >&2\nexit 1\n')
    broken.chmod(0o755)
    env = {**os.environ, "CXX": str(broken), "JAXRL_LLM_KERNEL_CACHE": str(tmp_path / "kernels")}
    proc = subprocess.run([sys.executable, "train.py", "--algo", "grpo", "steps=1", "eval_size=8",
                           "rl.prompts_per_step=4", "rl.group_size=2", f"out_dir={tmp_path / 'run'}",
                           "export=false", "report=false", "tensorboard=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = next(line for line in proc.stdout.splitlines() if "sampler: " in line)
    assert ("sampler: the rollout engine, attention XLA (no kernel: " in header
            and "could not build decode_attention.cc: kernel.cc:1:1: error: this compiler is broken on purpose"
            in header), header
    assert "step 1/1" in proc.stdout


def test_the_header_names_the_kernels_a_run_uses():
    """`kernels.describe_paths`: the C++ attention where it builds, the AMX matmul only for bfloat16 models on an
    AMX CPU (else why not), XLA on a mesh (saying so), and the GPU's Pallas kernel unless the model has sinks."""
    from jaxrl_llm.engine.kernels import describe_paths

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    if cpu_kernel.unavailable_reason() is None:
        assert describe_paths(config, platform="cpu").startswith("attention the C++ kernel")
        assert "this one computes in float32" in describe_paths(config, platform="cpu")
        bf16 = describe_paths(config.replace(dtype="bfloat16"), platform="cpu")
        amx = cpu_kernel.packed_matmul_unavailable_reason()
        assert (f"matmuls XLA (no AMX kernel: {amx})" if amx else "matmuls the AMX kernel") in bf16
    mesh = describe_paths(config, devices=4, platform="cpu")
    assert mesh == ("attention XLA (no kernel: 4 devices an engine (the kernels run on one device)); "
                    "matmuls and sampling XLA")
    assert describe_paths(config, platform="gpu").startswith("attention Pallas (GPU);")
    sinks = describe_paths(config.replace(attention_sinks=True), platform="gpu")
    assert "no kernel: the model has attention sinks" in sinks


def test_the_kernels_command_builds_them_and_says_what_runs(tmp_path, monkeypatch, capsys):
    """`python -m jaxrl_llm kernels`: the CPU, the compiler, each kernel built (into the kernel cache it names) or
    why not, and the engine's paths; a compiler that fails is reported with its first error line, exit 0."""
    from jaxrl_llm.__main__ import main

    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "\ncompiler: " in out
    built = cpu_kernel.unavailable_reason() is None
    assert ("attention (decode_attention.cc): built" in out) == built
    assert "the rollout engine here, a bfloat16 model: attention " in out
    amx = cpu_kernel.packed_matmul_unavailable_reason()
    assert f"AMX matmul (packed_matmul.cc): {'built' if amx is None else 'not used: ' + amx}" in out
