"""The training attention seam (jaxrl_llm/models/attention.py): the XLA path equal to the dense attention
(tests/attention_reference.py) under the dense masks it replaces (left-padded rows, packed rows, a cache, windows,
soft caps, sinks); the Pallas kernels (GPU `mha`, TPU splash), in Pallas' interpreter on this CPU, equal to the XLA
path in outputs and gradients;
the seam lowering for CUDA (Triton, cuDNN) and TPU (Mosaic) with `jax.export`; the backend each platform and feature
set gets; no `[T, S]`-sized array in the chunked path's forward and backward; the blocked flash path of long causal
contexts (block pairs skipped, online softmax, its own backward) equal to the dense attention within float32 rounding,
its compiled memory linear in the context."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.models import attention as A
from jaxrl_llm.models.block import training_attention
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import forward_packed, init_params
from jaxrl_llm.models.sequences import Sequences
from tests.attention_reference import attention_allowed, dense_attention, segment_attention_allowed
from tests.numerics import assert_within_rounding

# Every test here runs in seconds (the kernels' interpreter at 40 tokens included).
pytestmark = pytest.mark.quick


def _qkv(batch: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0, keys: int | None = None
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, heads, head_dim))
    k, v = (rng.normal(size=(batch, keys or length, kv_heads, head_dim)) for _ in range(2))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))  # type: ignore[return-value]


def _packed_segments(rows: list[list[int]], length: int) -> jax.Array:
    """`[B, length]` segment ids of rows given as their sequences' lengths (1, 2, ... then 0s)."""
    out = np.zeros((len(rows), length), np.int32)
    for r, lengths in enumerate(rows):
        out[r, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return jnp.asarray(out)


def _left_padded(lengths: list[int], length: int) -> jax.Array:
    """`[B, length]` key mask of left-padded rows of `lengths` valid tokens."""
    return jnp.asarray(np.arange(length)[None] >= length - np.asarray(lengths)[:, None], jnp.int32)


CAP, SCALE = 3.0, 0.2


def _assert_equal_where_attending(out: jax.Array, expected: jax.Array, allowed: jax.Array, terms: int) -> None:
    """`out` within float32 rounding of the dense `expected` (sums of at most `terms` terms) at every query that
    may attend to a key (a query that attends to none has no defined output, and none is read)."""
    attending = np.asarray(allowed.any(-1))
    assert attending.any()
    assert_within_rounding(np.asarray(out)[attending], np.asarray(expected)[attending], terms=terms)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk", [0, 8, 13])
@pytest.mark.parametrize("extras", ["plain", "softcap+sinks"])
def test_the_xla_path_is_the_dense_attention_under_the_dense_masks(window, chunk, extras):
    """Left-padded rows (`attention_allowed`) and packed rows of several segments (`segment_attention_allowed`):
    the dense attention's outputs within float32 rounding at every query that attends to a key, chunked (static
    causal extents) or not, with a window, a soft cap, a scale and sinks."""
    q, k, v = _qkv(2, 29, 6, 2, 16)
    kwargs = dict(scale=SCALE, logit_softcap=CAP, sinks=jnp.linspace(-1.0, 1.0, 6)) if extras != "plain" else {}
    spec = A.AttentionSpec(window=window, softcap=kwargs.get("logit_softcap"), scale=kwargs.get("scale"))
    sinks = kwargs.pop("sinks", None)
    key_mask = _left_padded([29, 11], 29)
    segments = _packed_segments([[4, 9, 10], [1, 20, 3]], 29)
    for mask, allowed in ((A.AttentionMask.padded(key_mask, 29), attention_allowed(key_mask, 29, 0, window)),
                          (A.AttentionMask.packed(segments), segment_attention_allowed(segments, window))):
        expected = dense_attention(q, k, v, allowed, sinks=sinks, **kwargs)
        out = jax.jit(lambda q, k, v, m: A.xla_attention(q, k, v, m, spec, sinks=sinks, query_chunk=chunk))(
            q, k, v, mask)
        _assert_equal_where_attending(out, expected, allowed, terms=29 + 16)


@pytest.mark.parametrize("window", [None, 6])
def test_the_xla_path_writes_into_a_cache_as_before(window):
    """Queries at a traced `q_offset` into a longer cache of left-padded rows (prefill of 12 at slot 0, then 3
    queries at slot 12 of 24): the dense attention under `attention_allowed`, chunked over the queries (`lax.map`)
    and not."""
    q, k, v = _qkv(2, 12, 4, 4, 8, seed=1, keys=24)
    key_mask = jnp.concatenate([_left_padded([12, 5], 12), jnp.ones((2, 3), jnp.int32), jnp.zeros((2, 9), jnp.int32)],
                               axis=1)
    for start, queries in ((0, 12), (12, 3)):
        part = q[:, :queries]
        allowed = attention_allowed(key_mask, queries, jnp.int32(start), window)
        for chunk in (0, 4):
            expected = dense_attention(part, k, v, allowed)
            mask = A.AttentionMask.padded(key_mask, queries, jnp.int32(start))
            out = A.xla_attention(part, k, v, mask, A.AttentionSpec(window=window), query_chunk=chunk)
            _assert_equal_where_attending(out, expected, allowed, terms=24 + 8)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), window=st.sampled_from([None, 1, 3, 50]),
       chunk=st.sampled_from([0, 7]))
def test_any_packing_is_the_block_diagonal_dense_mask(lengths, window, chunk):
    """Property: any packing of sequences (then padding to 48 tokens) gives the dense attention under
    `segment_attention_allowed` within float32 rounding at every real query."""
    length = 48
    segments = _packed_segments([lengths], length)
    q, k, v = _qkv(1, length, 2, 1, 8, seed=len(lengths))
    assert sum(lengths) <= length
    allowed = segment_attention_allowed(segments, window)
    expected = dense_attention(q, k, v, allowed)
    out = A.xla_attention(q, k, v, A.AttentionMask.packed(segments), A.AttentionSpec(window=window),
                          query_chunk=chunk)
    _assert_equal_where_attending(out, expected, allowed, terms=length + 8)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), window=st.sampled_from([None, 1, 3, 50]),
       block=st.sampled_from([5, 16]))
def test_any_packing_is_the_block_diagonal_dense_mask_in_blocks(lengths, window, block):
    """Property: any packing (then padding to 48 tokens), in blocks of 5 or 16: `blocked_attention` gives
    `segment_attention_allowed`'s attention within float32 rounding at every real query."""
    length = 48
    segments = _packed_segments([lengths], length)
    q, k, v = _qkv(1, length, 2, 1, 8, seed=len(lengths))
    expected = dense_attention(q, k, v, segment_attention_allowed(segments, window))
    out = A.blocked_attention(q, k, v, A.AttentionMask.packed(segments), A.AttentionSpec(window=window), block=block)
    valid = np.asarray(segments > 0)[..., None]
    np.testing.assert_allclose(np.asarray(out) * valid, np.asarray(expected) * valid, atol=1e-6, rtol=1e-5)


def _value_and_grads(fn, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None, w: jax.Array
                      ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`sum(w * fn(q, k, v, sinks))` and its gradients wrt q, k, v (and the sinks when given), jitted."""
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    return jax.jit(jax.value_and_grad(lambda q, k, v, sinks: jnp.sum(w * fn(q, k, v, sinks)), argnums=argnums))(
        q, k, v, sinks)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(("window", "extras"), [(None, "plain"), (6, "plain"), (None, "softcap+sinks"),
                                                (11, "softcap+sinks")])
def test_the_blocked_path_is_the_dense_attention(group, window, extras):
    """Causal packed rows of several segments (and padding), `T = 45` in blocks of 8 (not a multiple):
    `blocked_attention` (block pairs skipped above the diagonal and outside windows, the online softmax, its flash
    backward) gives the dense attention's outputs and gradients (q, k, v, the sinks) within float32
    rounding at every real query, with GQA ratios 1, 3, 8, windows, a soft cap, a scale and sinks."""
    t = 45
    q, k, v = _qkv(2, t, 2 * group, 2, 16, seed=group)
    segments = _packed_segments([[6, 17, 1, 14], [40]], t)
    spec = A.AttentionSpec(window=window, **(dict(softcap=CAP, scale=SCALE) if extras != "plain" else {}))
    sinks = jnp.linspace(-1.0, 1.0, 2 * group) if extras != "plain" else None
    _assert_blocked_is_dense(q, k, v, segments, spec, sinks, lambda q, k, v, sinks: A.blocked_attention(
        q, k, v, A.AttentionMask.packed(segments), spec, sinks=sinks, block=8))


def _assert_blocked_is_dense(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, spec: A.AttentionSpec,
                             sinks: jax.Array | None, blocked) -> None:
    """`blocked(q, k, v, sinks)`'s outputs and gradients (of `sum(w * out)`, `w` random on real queries) within
    float32 rounding of the dense attention under `segment_attention_allowed(segments, window)`."""
    allowed = segment_attention_allowed(segments, spec.window)
    valid = (segments > 0)[..., None]
    w = jnp.asarray(np.random.default_rng(5).normal(size=(*q.shape[:2], q.shape[2] * q.shape[3])), jnp.float32) * valid

    def dense(q, k, v, sinks):
        return dense_attention(q, k, v, allowed, scale=spec.scale, logit_softcap=spec.softcap, sinks=sinks)

    np.testing.assert_allclose(np.asarray(blocked(q, k, v, sinks) * valid), np.asarray(dense(q, k, v, sinks) * valid),
                               atol=1e-6, rtol=1e-5)
    (value, grads), (ref, ref_grads) = _value_and_grads(blocked, q, k, v, sinks, w), _value_and_grads(
        dense, q, k, v, sinks, w)
    np.testing.assert_allclose(float(value), float(ref), rtol=1e-5)
    for name, g, r in zip(["q", "k", "v", "sinks"][:len(ref_grads)], grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=f"d{name}")
        assert float(jnp.abs(r).max()) > 0


def test_long_causal_self_attention_takes_the_blocked_path():
    """`xla_attention` unrolls causal self-attention's chunks up to `UNROLLED_LENGTH` queries and runs
    `blocked_attention` past it: at `T = 520` in chunks of 128 (5 chunks, the last of 8), packed rows with a
    window, a soft cap and sinks, the dense outputs and gradients."""
    assert A.UNROLLED_LENGTH < 520
    q, k, v = _qkv(1, 520, 6, 2, 8, seed=11)
    segments = _packed_segments([[130, 300, 60]], 520)
    spec = A.AttentionSpec(window=200, softcap=CAP)
    sinks = jnp.linspace(-1.0, 1.0, 6)

    def chunked(q, k, v, sinks, t=520):
        mask = A.AttentionMask.packed(segments[:, :t])
        return A.xla_attention(q[:, :t], k[:, :t], v[:, :t], mask, spec, sinks=sinks, query_chunk=128)

    assert "name=_blocked" in str(jax.make_jaxpr(chunked)(q, k, v, sinks))
    assert "name=_blocked" not in str(jax.make_jaxpr(functools.partial(chunked, t=A.UNROLLED_LENGTH))(q, k, v, sinks))
    _assert_blocked_is_dense(q, k, v, segments, spec, sinks, chunked)


@pytest.mark.parametrize("window", [None, 5])
def test_the_blocked_path_attends_queries_at_offsets_and_slots(window):
    """`blocked_attention` is the mask's function wherever the queries sit: 3 queries at a traced offset into a cache
    of 24 left-padded slots, and queries at their own slots (`AttentionMask.at_positions`, a -1 padding query, the
    engine's prefill), in blocks of 4: the `lax.map` path's outputs at every query that attends to a key."""
    q, k, v = _qkv(2, 12, 4, 2, 8, seed=3, keys=24)
    key_mask = jnp.concatenate([_left_padded([12, 5], 12), jnp.ones((2, 3), jnp.int32), jnp.zeros((2, 9), jnp.int32)],
                               axis=1)
    positions = jnp.asarray([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, -1], list(range(3, 15))], jnp.int32)
    spec = A.AttentionSpec(window=window)
    for mask, part in ((A.AttentionMask.padded(key_mask, 3, jnp.int32(12)), q[:, :3]),
                       (A.AttentionMask.at_positions(positions, 24), q)):
        expected = A.xla_attention(part, k, v, mask, spec, query_chunk=4)
        out = A.blocked_attention(part, k, v, mask, spec, block=4)
        real = np.asarray(mask.q_segments > 0)[..., None]
        np.testing.assert_allclose(np.asarray(out) * real, np.asarray(expected) * real, atol=1e-6, rtol=1e-5)


def _temp_mib(t: int, chunk: int) -> float:
    """Compiled temp memory (MiB) of the XLA path's value and gradient of causal self-attention at `T = t` in query
    chunks of `chunk` (one row, 9 heads on 3 key heads of 64, bfloat16 dots), compiled only."""
    q, kv = jax.ShapeDtypeStruct((1, t, 9, 64), jnp.float32), jax.ShapeDtypeStruct((1, t, 3, 64), jnp.float32)
    segments = jnp.ones((1, t), jnp.int32)

    def loss(q, k, v):
        out = A.xla_attention(q, k, v, A.AttentionMask.packed(segments), query_chunk=chunk,
                              compute_dtype=jnp.bfloat16)
        return jnp.sum(out ** 2)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_the_blocked_paths_memory_grows_linearly_with_the_context():
    """Issue 61: causal self-attention's compiled value and gradient in chunks of 256 needs at most ~2x the temp
    memory at twice the context (the unrolled chunks kept every chunk's scores: ~3.5x per doubling)."""
    small, large = _temp_mib(2048, 256), _temp_mib(4096, 256)
    assert large / small < 2.3, (small, large)


def test_the_decoder_takes_the_blocked_path_at_long_contexts():
    """The decoder's packed forward at T = 640 in query chunks of 64 attends through `blocked_attention` on both
    layer kinds, and at T = 128 through the unrolled chunks."""
    config = _model(attention_query_chunk=64, attention="xla")
    params = init_params(config, jax.random.key(0))

    def program(t: int) -> str:
        segments = _packed_segments([[t // 2, t // 4]], t)
        tokens = jnp.zeros((1, t), jnp.int32)
        return str(jax.make_jaxpr(lambda p: forward_packed(p, config, tokens, jnp.zeros((1, t), jnp.int32),
                                                           segments))(params))

    assert program(640).count("name=_blocked") == 2
    assert "name=_blocked" not in program(128)


def _assert_kernel_matches_xla(backend: str, q: jax.Array, k: jax.Array, v: jax.Array, mask: A.AttentionMask,
                               spec: A.AttentionSpec, sinks: jax.Array | None = None, block: int = 16) -> None:
    """Outputs and the gradients wrt q, k, v of `sum(w * out)` (`w` random on real queries, 0 on padding: no real
    query reads a padding query's output) within float32 tolerance of the XLA path."""
    valid = (mask.kv_segments > 0)[:, :, None]
    w = jnp.asarray(np.random.default_rng(7).normal(size=(*q.shape[:2], q.shape[2] * q.shape[3])), jnp.float32) * valid

    def loss(backend: str):
        return jax.jit(jax.value_and_grad(
            lambda q, k, v: jnp.sum(w * A.attention(q, k, v, mask, spec, sinks=sinks, backend=backend, block=block)),
            argnums=(0, 1, 2)))

    out = A.attention(q, k, v, mask, spec, sinks=sinks, backend=backend, block=block)
    ref = A.attention(q, k, v, mask, spec, sinks=sinks, backend="xla")
    np.testing.assert_allclose(np.asarray(out * valid), np.asarray(ref * valid), atol=2e-5, rtol=1e-5)
    (value, grads), (ref_value, ref_grads) = loss(backend)(q, k, v), loss("xla")(q, k, v)
    np.testing.assert_allclose(float(value), float(ref_value), atol=1e-3)  # a sum of ~10^4 terms
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=1e-4, err_msg=f"d{name}")
    assert float(jnp.abs(ref_grads[1]).max()) > 0


KERNELS = [("pallas_interpret", "pallas_gpu"), ("pallas_tpu_interpret", "pallas_tpu")]


@pytest.mark.parametrize(("backend", "kernel"), KERNELS)
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_each_kernel_gives_the_xla_paths_outputs_and_gradients(backend, kernel, group, head_dim):
    """Packed causal rows of several segments (and padding; 40 tokens, padded to the kernel's blocks), GQA ratios
    1, 3 and 8, heads of 64 and 128, in Pallas' interpreter: the XLA path's outputs and gradients. The TPU kernel's
    64-wide heads fall back to XLA (Mosaic's 128 lanes), and `attention_backend` says so."""
    q, k, v = _qkv(2, 40, group, 1, head_dim, seed=group)
    mask = A.AttentionMask.packed(_packed_segments([[7, 20, 9], [33]], 40))
    spec = A.AttentionSpec()
    features = A.features_of(spec, q, k, mask)
    chosen, reason = A.attention_backend(backend, "cpu", features)
    if kernel == "pallas_tpu" and head_dim % 128:
        assert chosen == "xla" and "multiple of 128" in reason
        return
    assert chosen == backend
    _assert_kernel_matches_xla(backend, q, k, v, mask, spec, block=16 if kernel == "pallas_gpu" else 128)


@pytest.mark.parametrize("window", [1, 9])
def test_the_tpu_kernel_masks_windows_and_caps_and_sinks_as_the_xla_path(window):
    """Splash's local mask (`t - s < W`), soft cap and sinks over packed rows (GQA 2), interpreted: the XLA path's
    outputs and gradients; the GPU kernel has none of them and falls back, saying which."""
    q, k, v = _qkv(2, 40, 4, 2, 128, seed=window)
    mask = A.AttentionMask.packed(_packed_segments([[12, 25], [3, 30]], 40))
    spec = A.AttentionSpec(window=window, softcap=CAP, scale=SCALE)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    _assert_kernel_matches_xla("pallas_tpu_interpret", q, k, v, mask, spec, sinks=sinks, block=128)
    features = A.features_of(spec, q, k, mask, sinks)
    assert A.attention_backend("pallas", "gpu", features) == ("xla", "xla: pallas_gpu has no sliding window")
    assert A.attention_backend("auto", "tpu", features)[0] == "pallas_tpu"


def test_each_platform_gets_its_kernel_where_it_covers_the_features():
    """auto: XLA on the CPU; the GPU kernel, else cuDNN (prefix rows, bfloat16), else XLA on GPU; splash on TPU for
    heads of 128; a cache, a soft cap, sinks fall back with a one-line reason; `describe` names the path."""
    plain = A.Features(A.AttentionSpec(), 64)
    wide = A.Features(A.AttentionSpec(window=8, softcap=30.0), 128, sinks=True)
    prefix = A.Features(A.AttentionSpec(window=8, layout="prefix"), 128, dtype="bfloat16")
    assert A.attention_backend("auto", "cpu", plain) == ("xla", "xla: no kernel on cpu")
    assert A.attention_backend("auto", "gpu", plain)[0] == "pallas_gpu"
    assert A.attention_backend("auto", "cuda", prefix) == ("cudnn", "cudnn: the platform kernel")
    assert A.attention_backend("auto", "rocm", prefix)[0] == "xla"  # no cuDNN on ROCm
    assert A.attention_backend("auto", "tpu", plain) == (
        "xla", "xla: pallas_tpu needs a head size that is a multiple of 128 (this one is 64)")
    assert A.attention_backend("auto", "tpu", wide)[0] == "pallas_tpu"
    backend, reason = A.attention_backend("auto", "gpu", wide)
    assert backend == "xla" and reason.startswith("xla: pallas_gpu has no sliding window; cudnn takes no segment ids")
    assert A.attention_backend("pallas", "cpu", plain)[0] == "pallas_interpret"
    assert A.attention_backend("cudnn", "gpu", plain) == (
        "xla", "xla: cudnn takes no segment ids (packed or left-padded rows), only prefix lengths")
    assert A.attention_backend("cudnn", "tpu", prefix) == ("xla", "xla: no cuDNN on tpu")
    assert A.attention_backend("xla", "gpu", plain) == ("xla", "xla: requested")
    cache = A.Features(A.AttentionSpec(), 128, cache=True)
    assert A.attention_backend("auto", "tpu", cache)[1] == (
        "xla: pallas_tpu attends only a sequence to itself (no queries into a cache)")
    with pytest.raises(ValueError, match="attention must be one of"):
        A.attention_backend("flash", "gpu", plain)
    assert A.describe({"all": ("xla", "xla: no kernel on cpu")}) == "XLA (chunked, no kernel on cpu)"
    assert A.describe({"global": ("pallas_gpu", "pallas_gpu: the platform kernel"),
                       "sliding": ("xla", "xla: pallas_gpu has no sliding window")}) == (
        "global Pallas GPU flash (segment ids); sliding XLA (chunked, pallas_gpu has no sliding window)")


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.parametrize(("platform", "backend", "call", "spec"), [
    ("cuda", "pallas_gpu", "__gpu$xla.gpu.triton", A.AttentionSpec()),
    ("tpu", "pallas_tpu", "tpu_custom_call", A.AttentionSpec(window=64, softcap=30.0)),
])
def test_the_seams_forward_and_backward_lower_with_the_kernel(platform, backend, call, spec):
    """A jitted forward + backward through the seam (bfloat16, GQA 2, packed segment ids) exports for CUDA and TPU
    from this CPU machine, the kernel's custom call in the module and no dense attention dot outside it."""
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def step(q, k, v, segments):
        def loss(q, k, v):
            out = A.attention(q, k, v, A.AttentionMask.packed(segments), spec, backend=backend,
                              compute_dtype=jnp.bfloat16)
            return jnp.sum(out.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    exported = jax.export.export(jax.jit(step), platforms=[platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(call)])(
        q, kv, kv, segments)
    text = exported.mlir_module()
    assert exported.platforms == (platform,) and call in _custom_calls(text)
    assert "256x256" not in text  # no [T, S] scores or mask outside the kernels


def test_cudnn_lowers_for_cuda_once_its_version_probe_is_answered(monkeypatch):
    """cuDNN's attention asks the local cuDNN for its version while lowering, so on a machine without one it cannot
    export ("cuDNN is not detected"); with the probe answered (a cuDNN 9.1, a Hopper) the seam's prefix-row, windowed,
    GQA forward + backward lowers to cuDNN's fused attention calls."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    spec = A.AttentionSpec(window=32, layout="prefix")

    def step(q, k, v, segments):
        def loss(q, k, v):
            out = A.attention(q, k, v, A.AttentionMask.packed(segments), spec, backend="cudnn",
                              compute_dtype=jnp.bfloat16)
            return jnp.sum(out.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    def export() -> str:
        calls = [jax.export.DisabledSafetyCheck.custom_call(c)
                 for c in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]
        return jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=calls)(
            q, kv, kv, segments).mlir_module()

    if fused.cuda_versions is None:  # this machine: no CUDA libraries
        with pytest.raises(RuntimeError, match="cuDNN"):
            export()
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    calls = _custom_calls(export())
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls


def _avals(jaxpr: jax.extend.core.Jaxpr) -> list[jax.core.ShapedArray]:
    """Every variable's abstract value in `jaxpr` and the jaxprs inside it (scans, checkpoints, custom rules)."""
    out = [v.aval for v in jaxpr.invars]
    for eqn in jaxpr.eqns:
        out += [v.aval for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _avals(sub)
    return out


@pytest.mark.parametrize("mask_kind", ["packed", "cache"])
def test_the_chunked_path_has_no_query_by_key_array(mask_kind):
    """Issue 61's "no [T, S]-sized array in the compiled update": the XLA path's value and gradient at T = 512 in
    chunks of 64 (packed rows: static causal extents; a cache at a traced offset: `lax.map`) hold no array with two
    axes of at least T (a [T, S] mask, scores or probabilities); the unchunked path does (the check sees them)."""
    t = 512
    q, k, v = _qkv(1, t, 4, 2, 8)
    segments = _packed_segments([[100, 300, 50]], t)
    mask = (A.AttentionMask.packed(segments) if mask_kind == "packed"
            else A.AttentionMask.padded(segments > 0, t, 0))

    def big(chunk: int) -> list[tuple[int, ...]]:
        def loss(q, k, v):
            return jnp.sum(A.xla_attention(q, k, v, mask, A.AttentionSpec(window=200), query_chunk=chunk) ** 2)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
        return [a.shape for a in _avals(jaxpr) if sum(d >= t for d in getattr(a, "shape", ())) >= 2]

    assert big(64) == []
    assert big(0)  # the check sees a dense one where it exists


def _model(**overrides) -> ModelConfig:
    settings = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, sliding_window=6, layer_types=("full_attention", "sliding_attention"),
                    attention_query_chunk=16)
    return ModelConfig(**{**settings, **overrides})


@pytest.mark.parametrize(("backend", "head_dim"), [("pallas_interpret", 16), ("pallas_tpu_interpret", 128)])
def test_the_decoder_trains_through_the_kernels_as_through_xla(backend, head_dim):
    """Packed rows through the decoder (a global and a sliding-window layer in one scanned stack, each kind's
    attention picked by the scanned flag): with the GPU kernel on the global layers (its sliding layers on XLA) or
    splash on both, the hidden states and the parameters' gradients are the XLA path's."""
    config = _model(head_dim=head_dim, attention="xla")
    params = init_params(config, jax.random.key(0))
    segments = _packed_segments([[9, 14, 5], [30]], 33)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, segments.shape), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in (9, 14, 5, 5)])[None].repeat(2, 0), jnp.int32)
    positions = jnp.where(segments == 2, jnp.arange(33)[None] - 9, positions)  # any per-segment positions
    valid = (segments > 0)[..., None]

    def run(attention: str):
        c = dataclasses.replace(config, attention=attention)
        return jax.jit(jax.value_and_grad(lambda p: jnp.sum(
            jnp.where(valid, forward_packed(p, c, tokens, positions, segments), 0.0) ** 2)))(params)

    (value, grads), (ref, ref_grads) = run(backend), run("xla")
    kernel = dataclasses.replace(config, attention=backend)
    program = str(jax.make_jaxpr(lambda p: forward_packed(p, kernel, tokens, positions, segments))(params))
    assert "pallas_call" in program and "cond" in program  # the kernel runs, inside the scanned kind's branch
    np.testing.assert_allclose(float(value), float(ref), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-4, rtol=2e-4)


def test_the_header_names_each_layer_kinds_attention():
    """`block.training_attention` + `describe`: the CPU's XLA, the GPU kernel on global layers only (a window),
    splash on both kinds on TPU for heads of 128, and `model.attention=xla` as asked."""
    config = _model()
    assert A.describe(training_attention(config, "cpu")) == "XLA (chunked, no kernel on cpu)"
    assert A.describe(training_attention(config, "gpu")) == (
        "global Pallas GPU flash (segment ids); sliding XLA (chunked, pallas_gpu has no sliding window; cudnn takes "
        "no segment ids (packed or left-padded rows), only prefix lengths)")
    assert A.describe(training_attention(_model(head_dim=128), "tpu")) == "Pallas TPU splash (segment ids)"
    assert A.describe(training_attention(_model(attention="xla"), "tpu")) == "XLA (chunked)"
    with pytest.raises(ValueError, match="attention must be one of auto, xla, pallas, cudnn"):
        _model(attention="flash")


def test_the_decoders_update_has_no_query_by_key_array():
    """The decoder's packed forward and its gradient at T = 256 in query chunks of 32 (two layer kinds, a window):
    no array with two axes of at least T anywhere in the program (issue 61's linear memory in the context)."""
    config = _model(attention_query_chunk=32)
    params = init_params(config, jax.random.key(0))
    t = 256
    segments = _packed_segments([[100, 120, 20]], t)
    tokens = jnp.zeros((1, t), jnp.int32)

    def loss(p):
        return jnp.sum(forward_packed(p, config, tokens, jnp.zeros((1, t), jnp.int32), segments) ** 2)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr
    assert [a.shape for a in _avals(jaxpr) if sum(d >= t for d in getattr(a, "shape", ())) >= 2] == []


@pytest.mark.quick
def test_the_decoders_update_memory_grows_linearly_in_a_layer_stack():
    """Inside the decoder's scanned layer stack (remat on), the packed forward and backward at T = 2048 and 4096 in
    blocks of 256 compile to temporaries about 2x apart: the block masks stay inside the block loops (`_tied`).
    Without the barrier they were hoisted and kept for every block pair (4x and more per doubling)."""
    config = _model(attention_query_chunk=256, remat=True, sliding_window=None, layer_types=None, num_layers=2)

    def temp(t: int) -> int:
        shape = jax.ShapeDtypeStruct((1, t), jnp.int32)
        params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))

        def loss(p, tokens, positions, segments):
            return jnp.sum(forward_packed(p, config, tokens, positions, segments) ** 2)

        compiled = jax.jit(jax.grad(loss)).lower(params, shape, shape, shape).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(4096) < 2.3 * temp(2048)


@pytest.mark.quick
@pytest.mark.parametrize(("platform", "backend", "call"), [
    ("cuda", "pallas_gpu", "__gpu$xla.gpu.triton"), ("tpu", "pallas_tpu", "tpu_custom_call")])
def test_the_update_exports_with_the_kernel(platform, backend, call):
    """The GRPO train step itself (policy loss with a KL term on packed rows, backward, AdamW; bfloat16 over float32
    weights, remat) with `model.attention` set to the platform's kernel exports for that platform from this CPU
    machine, the kernel's call in it: what a GPU or TPU run compiles."""
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.models.decoder import param_shapes
    from jaxrl_llm.models.packing import PackedLayout
    from jaxrl_llm.optim import make_optimizer
    from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss
    from jaxrl_llm.trainers.step import train_step

    config = _model(head_dim=128, num_heads=4, num_kv_heads=2, sliding_window=None, layer_types=None,
                    dtype="bfloat16", remat=True, attention=backend)
    optimizer = make_optimizer(OptimSection(learning_rate=1e-6), 10)[0]
    shapes = param_shapes(config)
    n, p, t, rows, width = 4, 16, 48, 2, 128
    ints, floats = (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32))
    batch = PolicyBatch(Sequences(ints(n, p), ints(n, p), ints(n, t), ints(n, t)), floats(n, t), floats(n, t),
                        floats(n),
                        layout=PackedLayout(ints(rows, width), ints(n, t)))
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config, optimizer=optimizer, grad_accum=1,
                             loss_config=PolicyObjective(beta=0.04, max_len=t))
    # LayoutConstraint: the precision policy's row-major weight-gradient operands, chosen by this CPU's backend.
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in (call, "LayoutConstraint")]
    exported = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=checks)(
        shapes, jax.eval_shape(optimizer.init, shapes), batch)
    assert exported.platforms == (platform,) and call in _custom_calls(exported.mlir_module())
