"""The precision policy (`models/precision.py`), read from the lowered programs: under `model.dtype=bfloat16`
every dot of the model, the token step, the log-prob path and the train step's gradient has bfloat16 operands
and a float32 result; under float32 every dot is float32 as before. Plus the policy's gradients against a
float32 reference, and bf16-stored inference weights computing what the float32 master computes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models import precision
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import decode_token, loop_caches, prefill, split_layers
from jaxrl_llm.models.decoder import forward, init_params
from jaxrl_llm.models.heads import apply_scalar_head
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.step_weights import step_weights
from jaxrl_llm.models.weights import inference_copy
from jaxrl_llm.trainers.objectives import completion_logprobs
from tests.numerics import compiled_dot_operand_types

pytestmark = pytest.mark.quick

DOT = re.compile(r"stablehlo\.dot_general[^\n]*?:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def _element_type(tensor: str) -> str:
    return tensor[len("tensor<"):-1].split("x")[-1]


def dot_types(lowered_text: str) -> list[tuple[str, str, str]]:
    """`(lhs, rhs, result)` element types of every `dot_general` in a lowered StableHLO module."""
    return [tuple(_element_type(t) for t in m.groups()) for m in DOT.finditer(lowered_text)]  # type: ignore[misc]


def _config(dtype: str, **overrides) -> ModelConfig:
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, qkv_bias=True, o_bias=True, mlp_bias=True, dtype=dtype)
    return ModelConfig(**{**fields, **overrides})


def _batch(rng: np.random.Generator, rows: int = 3, prompt: int = 5, new: int = 4):
    pt = jnp.asarray(rng.integers(0, 96, (rows, prompt)), jnp.int32)
    pm = jnp.ones((rows, prompt), jnp.int32).at[0, :2].set(0)
    ct = jnp.asarray(rng.integers(0, 96, (rows, new)), jnp.int32)
    cm = jnp.ones((rows, new), jnp.int32).at[1, 2:].set(0)
    return pt, pm, ct, cm


def _programs(config: ModelConfig) -> dict[str, str]:
    """Lowered text of the forward, the log-prob loss's gradient (the update's dots, forward and backward), the
    token step (with prefill) and a scalar head."""
    params = init_params(config, jax.random.key(0))
    pt, pm, ct, cm = _batch(np.random.default_rng(0))

    def loss(p):
        logp, ent, _ = completion_logprobs(p, config, Sequences(pt, pm, ct, cm), with_entropy=True, block_mib=0.001)
        return -(logp * cm).sum() - ent.sum()

    def token_step(p):
        layers = split_layers(p, config)
        logits, caches, _ = prefill(p, layers, config, pt, pm)
        caches = [{k: jnp.pad(v, ((0, 0), (0, 2), (0, 0), (0, 0))) for k, v in c.items()} for c in caches]
        key_mask = jnp.concatenate([pm, jnp.ones((3, 2), jnp.int32)], axis=1)
        out, _, _ = decode_token(p, step_weights(layers, config), config, jnp.argmax(logits, -1),
                              jnp.full((3,), 5), key_mask, loop_caches(caches), jnp.int32(5))
        return out

    head = {"kernel": jnp.ones((config.hidden_size, 1)), "bias": jnp.zeros((1,))}
    return {
        "forward": jax.jit(lambda p: forward(p, config, pt, pm)).lower(params).as_text(),
        "logprob gradient": jax.jit(jax.grad(loss)).lower(params).as_text(),
        "token step": jax.jit(token_step).lower(inference_copy(params, config)).as_text(),
        "scalar head gradient": jax.jit(jax.grad(lambda h, x: apply_scalar_head(h, x, config.jnp_dtype).sum(),
                                                 argnums=(0, 1))).lower(head, jnp.ones((3, 32))).as_text(),
    }


@pytest.mark.parametrize("tied", [True, False])
def test_every_dot_is_bf16_in_float32_out_under_bfloat16(tied):
    """The fast path on XLA:CPU (bf16 x bf16 -> f32 runs on AMX); a raw bf16 dot (-> bf16) or a float32 dot of
    upcast operands anywhere in these programs fails this test."""
    assert jax.default_backend() == "cpu"
    for name, text in _programs(_config("bfloat16", tie_word_embeddings=tied)).items():
        types = dot_types(text)
        # forward: 7 projections x 2 layers + q.k, p.v x 2 + unembed; the gradient has three times as many
        assert len(types) >= (2 if "head" in name else 8), (name, len(types))
        wrong = [t for t in types if t != ("bf16", "bf16", "f32")]
        assert not wrong, f"{name}: dots off the policy: {wrong[:5]}"


def test_float32_model_keeps_float32_dots():
    for name, text in _programs(_config("float32")).items():
        types = dot_types(text)
        assert types and all(t == ("f32", "f32", "f32") for t in types), (name, set(types))


def test_policy_einsum_gradients_match_float32_reference():
    """`precision.einsum`'s custom gradients are the einsum's gradients with bf16-rounded operands and
    cotangent: checked against float32 autodiff of the same rounded values (attention's two contractions and
    a plain matmul), and returned in the operands' own dtype."""
    rng = np.random.default_rng(1)
    cases = [("btkgd,bskd->bkgts", (2, 3, 2, 2, 4), (2, 5, 2, 4)),
             ("bkgts,bskd->btkgd", (2, 2, 2, 3, 5), (2, 5, 2, 4)), ("ik,kn->in", (6, 4), (4, 3))]
    for spec, sa, sb in cases:
        a = jnp.asarray(rng.normal(size=sa), jnp.float32)
        b = jnp.asarray(rng.normal(size=sb), jnp.float32)
        out_shape = jnp.einsum(spec, a, b).shape
        g = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
        rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        out, vjp = jax.vjp(lambda x, y, s=spec: precision.einsum(s, x, y, jnp.bfloat16), a, b)
        ref_out, ref_vjp = jax.vjp(lambda x, y, s=spec: jnp.einsum(s, x, y, precision="highest"), rounded(a),
                                   rounded(b))
        np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
        for got, want in zip(vjp(g), ref_vjp(rounded(g)), strict=True):
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_inference_copy_computes_what_the_float32_master_computes():
    """Sampler and reference weights stored in bf16 (matrices only) give the float32 master's logits exactly:
    every dot reads its weights in bf16 either way. The copy holds half the matrix bytes."""
    config = _config("bfloat16")
    params = init_params(config, jax.random.key(3))
    copy = inference_copy(params, config)
    assert copy["layers"]["mlp"]["up"]["kernel"].dtype == jnp.bfloat16
    assert copy["layers"]["mlp"]["up"]["bias"].dtype == jnp.float32  # vectors stay as they are
    pt, pm, _, _ = _batch(np.random.default_rng(2))
    np.testing.assert_array_equal(forward(params, config, pt, pm), forward(copy, config, pt, pm))
    assert inference_copy(params, _config("float32"))["layers"]["mlp"]["up"]["kernel"].dtype == jnp.float32


def test_activations_are_float32_on_cpu_and_the_dot_output_of_the_backend():
    assert precision.activation_dtype("bfloat16") == jnp.float32  # XLA:CPU: the fast dot returns float32
    assert precision.activation_dtype("float32") == jnp.float32
    assert _config("bfloat16").jnp_activation_dtype == jnp.float32
    assert _config("bfloat16").jnp_inference_param_dtype == jnp.bfloat16
    assert _config("float32").jnp_inference_param_dtype == jnp.float32


@pytest.mark.parametrize("gemma", [False, True])
def test_bf16_activation_path_of_other_backends(monkeypatch, gemma):
    """Where the fast dot returns bf16 (GPUs), activations are bf16; the logits, attention scores, log-probs and
    head outputs stay float32 and every gradient reaching the master is float32. Run here by telling the policy
    the backend prefers bf16 outputs (no GPU in the suite)."""
    monkeypatch.setattr(precision, "float32_output_is_fast", lambda: False)
    extra = (dict(sandwich_norms=True, norm_unit_offset=True, embed_scale=True, attn_logit_softcap=50.0,
                  final_logit_softcap=30.0, hidden_act="gelu_pytorch_tanh", qk_norm=True) if gemma
             else dict(tie_word_embeddings=True))
    config = _config("bfloat16", **extra)
    assert config.jnp_activation_dtype == jnp.bfloat16
    params = init_params(config, jax.random.key(4))
    pt, pm, ct, cm = _batch(np.random.default_rng(4))
    hidden = forward(params, config, pt, pm, return_hidden=True)
    assert hidden.dtype == jnp.bfloat16
    logits = forward(params, config, pt, pm)
    ref = forward(params, _config("float32", **extra), pt, pm)
    assert logits.dtype == jnp.float32
    valid = np.asarray(pm, bool)
    assert (np.asarray(logits).argmax(-1) == np.asarray(ref).argmax(-1))[valid].mean() >= 0.9

    def loss(p):
        logp, ent, _ = completion_logprobs(p, config, Sequences(pt, pm, ct, cm), with_entropy=True, block_mib=0.001)
        assert logp.dtype == jnp.float32
        return -(logp * cm).sum() - ent.sum()

    grads = jax.grad(loss)(params)
    assert all(g.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("rows", [256, 251])
def test_weight_gradients_run_as_bf16_dots_on_the_cpu(rows):
    """XLA:CPU runs a bf16 dot contracting both operands' leading axis (a weight gradient `x^T g`) as a float32 dot
    of upcast operands, 2-4x slower; `precision` gives it the form the bf16 kernel takes. Read from the compiled
    program: every dot of a bf16 matmul's forward and backward, the tied unembedding's included, has bf16
    operands; and the gradients are the float32 reference's."""
    assert jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 192)), jnp.float32)
    for fn, weight in ((precision.matmul, w), (precision.matmul_transposed, w.T)):
        def loss(x, w, fn=fn):
            return (fn(x, w, jnp.bfloat16) ** 2).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        types = compiled_dot_operand_types(grad.lower(x, weight).compile().as_text())
        assert len(types) >= 3 and all(t == ("bf16", "bf16") for t in types), types
        rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        g = rounded(2 * (rounded(x) @ rounded(w)))
        want = (g @ rounded(w).T, rounded(x).T @ g)
        for got, ref in zip(grad(x, weight), want, strict=True):
            ref = ref if got.shape == ref.shape else ref.T
            np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)


def test_the_update_compiles_to_bf16_dots_only_with_tied_embeddings():
    """The log-prob loss's gradient (the update's dots, the chunked tied unembedding included) read from the
    compiled program: no dot runs on upcast float32 operands. (The tied embedding passed as `embedding.T` gave
    XLA a transpose to fold into the dot, and the LM head and its gradients ran in float32.)"""
    assert jax.default_backend() == "cpu"
    config = _config("bfloat16", tie_word_embeddings=True, vocab_size=512, hidden_size=64, intermediate_size=128,
                     head_dim=16)
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    pt = jnp.asarray(rng.integers(0, 512, (8, 24)), jnp.int32)
    ct = jnp.asarray(rng.integers(0, 512, (8, 40)), jnp.int32)
    pm, cm = jnp.ones_like(pt), jnp.ones_like(ct)

    def loss(p):
        logp, ent, _ = completion_logprobs(p, config, Sequences(pt, pm, ct, cm), with_entropy=True, block_mib=0.5)
        return -(logp * cm).sum() - ent.sum()

    types = compiled_dot_operand_types(jax.jit(jax.grad(loss)).lower(params).compile().as_text())
    assert len(types) >= 10 and all(t == ("bf16", "bf16") for t in types), [t for t in types if t != ("bf16", "bf16")]


# ------------------------------------------------------------------------------------------- model.dtype: auto

AVX2_ONLY = "fpu sse sse2 avx avx2 fma"  # a Zen 2/3 server, most laptops: no bfloat16 dots


@pytest.mark.parametrize(("backend", "machine", "flags", "want"), [
    ("cpu", "x86_64", AVX2_ONLY, "float32"),
    ("cpu", "x86_64", f"{AVX2_ONLY} avx512f avx512_bf16", "bfloat16"),  # Zen 4, Cooper Lake
    ("cpu", "x86_64", f"{AVX2_ONLY} avx512f amx_tile amx_bf16", "bfloat16"),  # Sapphire Rapids
    ("cpu", "aarch64", "fp asimd sve", "float32"),
    ("cpu", "aarch64", "fp asimd sve bf16", "bfloat16"),  # Graviton 3, Apple M2+
    ("cpu", "x86_64", "fpu avx2 bf16", "float32"),  # an Arm flag name on x86 means nothing
    ("gpu", "x86_64", AVX2_ONLY, "bfloat16"),
    ("tpu", "x86_64", "", "bfloat16"),
])
def test_auto_picks_bfloat16_only_where_the_hardware_has_bfloat16_dots(backend, machine, flags, want):
    dtype, why = precision.auto_compute_dtype(backend, flags, machine)
    assert dtype == want and why.startswith(f"model.dtype=auto: {want}")
    feature = precision.cpu_bf16_feature(flags, machine)
    if backend == "cpu":
        assert (feature is not None) == (want == "bfloat16") and (feature is None or feature in why)


def test_auto_reaches_the_model_and_the_run_header(monkeypatch, tiny_task, tmp_path):
    """A run with `model.dtype=auto` on a CPU reporting AVX2 only computes in float32 and says why in its header; on
    one reporting AMX, in bfloat16; `float32` and `bfloat16` as written are kept whatever the CPU."""
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.trainers import make_trainer
    from tests.families import TINY
    from tests.runs import tiny_run

    monkeypatch.setattr(precision.host_platform, "machine", lambda: "x86_64")
    for flags, want in ((AVX2_ONLY, "float32"), (f"{AVX2_ONLY} amx_tile amx_bf16", "bfloat16")):
        monkeypatch.setattr(precision, "_cpu_flags", lambda flags=flags: flags)
        assert config_from_hf({**TINY, "vocab_size": 64}, dtype="auto").dtype == want
        assert config_from_hf({**TINY, "vocab_size": 64}, dtype="float32").dtype == "float32"
        assert config_from_hf({**TINY, "vocab_size": 64}, dtype="bfloat16").dtype == "bfloat16"
    monkeypatch.setattr(precision, "_cpu_flags", lambda: AVX2_ONLY)
    config = tiny_run("grpo_arithmetic", tmp_path / "run", "model.dtype=auto", task=tiny_task)
    algorithm = make_trainer(config).algorithm
    assert algorithm.policy.model_config.dtype == "float32"
    assert "compute dtype float32 (model.dtype=auto: float32, the CPU has no bfloat16 dots" in algorithm.describe()
