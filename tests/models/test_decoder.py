"""Decoder parity with transformers (PyTorch CPU), HF import/export round trip, KV cache, errors."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.decode import decode_layers, init_caches, split_layers
from jaxrl_llm.models.decoder import forward
from jaxrl_llm.models.hf import ConversionError, load_hf_model
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.models.layers import positions_from_mask
from jaxrl_llm.models.options import REMAT_POLICIES
from tests.families import FAMILIES, hf_logits, left_padded_batch, make_hf_model
from tests.runs import STORIES260K, requires_shared

pytestmark = pytest.mark.quick

LENGTHS = [12, 7, 3, 12]


def _max_diff_on_valid(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    valid = mask.astype(bool)
    return float(np.abs(np.asarray(ours, np.float32)[valid] - ref[valid]).max())


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logit_parity_float32(kind, hf_model_dir):
    model_dir = hf_model_dir(kind)
    config, params = load_hf_model(model_dir)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=1)
    ref = hf_logits(make_hf_model(kind), tokens, mask)
    ours = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    assert ours.dtype == jnp.float32
    assert _max_diff_on_valid(ours, ref, mask) <= 1e-4


def test_family_switches_are_read(hf_model_dir):
    """Each family's distinguishing switch reaches ModelConfig (else parity above could pass by luck)."""
    assert load_hf_model(hf_model_dir("qwen2"))[0].qkv_bias
    assert load_hf_model(hf_model_dir("qwen2"))[0].tie_word_embeddings
    assert "lm_head" not in load_hf_model(hf_model_dir("qwen2"))[1]
    qwen3 = load_hf_model(hf_model_dir("qwen3"))[0]
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size
    assert load_hf_model(hf_model_dir("mistral"))[0].sliding_window == 4
    assert dict(load_hf_model(hf_model_dir("llama3_rope"))[0].rope_scaling)["rope_type"] == "llama3"
    biased = load_hf_model(hf_model_dir("llama_linear_rope_bias"))[0]
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias


def test_sliding_window_changes_logits(hf_model_dir):
    """Mistral's window (4) really restricts attention: a full-attention run of the same weights differs."""
    config, params = load_hf_model(hf_model_dir("mistral"))
    tokens, mask = left_padded_batch(config.vocab_size, [12], seed=2)
    windowed = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    full = forward(params, config.replace(sliding_window=None), jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_allclose(windowed[:, :4], full[:, :4], atol=1e-6)  # inside the window: identical
    assert float(jnp.abs(windowed[:, 4:] - full[:, 4:]).max()) > 1e-3


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logit_parity_bfloat16(kind, hf_model_dir):
    """bf16 weights and compute (the precision policy: bf16 dot operands, float32 accumulation and activations)
    vs float32 transformers, per family: our error is at most 1.5x the error of transformers' own bf16 run,
    and the argmax agrees on >= 90% of valid positions."""
    import torch

    model_dir = hf_model_dir(kind)
    config, params = load_hf_model(model_dir, param_dtype="bfloat16", dtype="bfloat16")
    assert params["embed"]["embedding"].dtype == jnp.bfloat16
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=1)
    ref = hf_logits(make_hf_model(kind), tokens, mask)
    hf_bf16_error = _max_diff_on_valid(hf_logits(make_hf_model(kind).to(torch.bfloat16), tokens, mask), ref, mask)
    ours = np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)), np.float32)
    valid = mask.astype(bool)
    assert _max_diff_on_valid(ours, ref, mask) <= 1.5 * hf_bf16_error
    assert (ours[valid].argmax(-1) == ref[valid].argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("kind", ["llama_linear_rope_bias", "qwen2", "qwen3", "mistral"])
def test_export_round_trip_through_transformers(kind, hf_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config, params = load_hf_model(hf_model_dir(kind))
    out = save_hf_model(params, config, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=3)
    original = hf_logits(make_hf_model(kind), tokens, mask)
    assert _max_diff_on_valid(hf_logits(reloaded, tokens, mask), original, mask) <= 1e-5


def test_sharded_export_and_import(hf_model_dir, tmp_path):
    config, params = load_hf_model(hf_model_dir("qwen3"))
    out = save_hf_model(params, config, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    _, again = load_hf_model(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_import_hf_sharded_checkpoint(tmp_path):
    """transformers' own sharded layout (model.safetensors.index.json) imports with the same logits."""
    model = make_hf_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, params = load_hf_model(tmp_path)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=4)
    ours = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    assert _max_diff_on_valid(ours, hf_logits(model, tokens, mask), mask) <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_kv_cache_decoding_matches_full_forward(kind, hf_model_dir):
    """Prefill a left-padded prompt, then decode token by token: logits equal the full forward pass."""
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [10, 4, 7], seed=5)
    prompt_len, new = 6, tokens.shape[1] - 6
    full = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask))

    step = jax.jit(lambda p, t, pos, km, c, i: decode_layers(p, split_layers(p, config), config, t, pos, km, c, i)[:2])
    positions = positions_from_mask(jnp.asarray(mask))
    key_mask = jnp.zeros((3, tokens.shape[1] + 2), jnp.int32).at[:, :prompt_len].set(mask[:, :prompt_len])
    cache = init_caches(config, 3, tokens.shape[1] + 2)
    logits, cache = step(params, tokens[:, :prompt_len], positions[:, :prompt_len], key_mask, cache, 0)
    got = [logits]
    for i in range(prompt_len, prompt_len + new):
        key_mask = key_mask.at[:, i].set(mask[:, i])
        logits, cache = step(params, tokens[:, i : i + 1], positions[:, i : i + 1], key_mask, cache, i)
        got.append(logits)
    assert _max_diff_on_valid(np.concatenate(got, axis=1), np.asarray(full), mask) <= 1e-5


def test_remat_gives_same_logits_and_grads(hf_model_dir):
    config, params = load_hf_model(hf_model_dir("llama"))
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=6)

    def loss(p, c):
        return forward(p, c, jnp.asarray(tokens), jnp.asarray(mask)).astype(jnp.float32).std()

    g1 = jax.grad(loss)(params, config)
    for policy in REMAT_POLICIES:
        g2 = jax.grad(loss)(params, config.replace(remat=True, remat_policy=policy))
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def _dot_count(jaxpr: jax.extend.core.Jaxpr) -> int:
    """`dot_general`s in a jaxpr and every jaxpr nested in it (a scan's body counted once)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    count += _dot_count(inner)
    return count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_remat_policy_saves_the_weight_matmuls(hf_model_dir, dtype):
    """`full` recomputes every forward matmul in the backward pass; `matmuls` keeps the q/k/v/o/gate/up/down
    outputs (named by `precision.matmul`: under bfloat16 the dot sits in a custom VJP) and recomputes only
    attention's two batched dots. Compiled memory orders the same way: full < matmuls < no remat."""
    config, params = load_hf_model(hf_model_dir("llama"))
    config = config.replace(dtype=dtype)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=6)

    def measure(c):
        loss = lambda p: forward(p, c, jnp.asarray(tokens), jnp.asarray(mask)).astype(jnp.float32).std()  # noqa: E731
        temp = jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
        return _dot_count(jax.make_jaxpr(jax.grad(loss))(params).jaxpr), temp

    (plain, plain_mem), (full, full_mem) = measure(config), measure(config.replace(remat=True, remat_policy="full"))
    saved, saved_mem = measure(config.replace(remat=True, remat_policy="matmuls"))
    assert saved - plain == 2  # q.k and p.v, recomputed
    assert full - saved >= 6  # the weight matmuls that `matmuls` keeps are recomputed under `full`
    assert full_mem < saved_mem < plain_mem


# ------------------------------------------------------------------------------------ real checkpoint


@requires_shared(STORIES260K)
def test_stories260k_logit_parity():
    from transformers import AutoModelForCausalLM

    config, params = load_hf_model(STORIES260K)
    assert config.tie_word_embeddings and config.num_kv_heads == 4
    hf = AutoModelForCausalLM.from_pretrained(STORIES260K, attn_implementation="eager").eval()
    tokens, mask = left_padded_batch(config.vocab_size, [45, 20, 33], seed=7)
    tokens[:, :][mask == 1] = np.where(tokens[mask == 1] < 3, 300, tokens[mask == 1])
    ours = forward(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    assert _max_diff_on_valid(ours, hf_logits(hf, tokens, mask), mask) <= 1e-4


def _greedy(params, config, prompt: list[int], new_tokens: int) -> list[int]:
    """A plain jitted greedy loop on the KV cache (the fast sampler lives in jaxrl_llm.sampling)."""
    total = len(prompt) + new_tokens
    cache = init_caches(config, 1, total)
    step = jax.jit(lambda p, t, pos, km, c, i: decode_layers(p, split_layers(p, config), config, t, pos, km, c, i)[:2])
    key_mask = jnp.zeros((1, total), jnp.int32).at[:, : len(prompt)].set(1)
    positions = jnp.arange(len(prompt))[None]
    logits, cache = step(params, jnp.asarray([prompt]), positions, key_mask, cache, 0)
    out = []
    for i in range(len(prompt), total):
        token = int(jnp.argmax(logits[0, -1]))
        out.append(token)
        key_mask = key_mask.at[:, i].set(1)
        logits, cache = step(params, jnp.asarray([[token]]), jnp.asarray([[i]]), key_mask, cache, i)
    return out


@requires_shared(STORIES260K)
def test_stories260k_greedy_matches_transformers_generate():
    import torch
    from transformers import AutoModelForCausalLM

    reference = json.loads((STORIES260K / "reference_greedy.json").read_text())
    prompt = reference["prompt_ids"]
    config, params = load_hf_model(STORIES260K)
    ours = _greedy(params, config, prompt, 40)
    hf = AutoModelForCausalLM.from_pretrained(STORIES260K).eval()
    with torch.no_grad():
        generated = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
    assert ours == generated[0, len(prompt) :].tolist()
    assert ours == reference["greedy_new_ids"]


# ----------------------------------------------------------------------------------------------- errors


def test_unknown_model_type_lists_supported(hf_model_dir, tmp_path):
    model_dir = tmp_path / "gpt2"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"unsupported model_type 'gpt2'.*llama, mistral, qwen2, qwen3, phi3"):
        load_hf_model(model_dir)


def test_unsupported_rope_scaling_is_named(hf_model_dir, tmp_path):
    model_dir = tmp_path / "dynamic"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="unsupported rope_scaling type .dynamic.*llama3, yarn, longrope"):
        load_hf_model(model_dir)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConversionError, match="config.json"):
        load_hf_model(tmp_path)


def test_missing_tensor_is_named(hf_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = tmp_path / "missing"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load_hf_model(model_dir)


def test_mismatched_tensor_is_named(hf_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    model_dir = tmp_path / "mismatch"
    shutil.copytree(hf_model_dir("llama"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[8, 32\]"):
        load_hf_model(model_dir)


def test_bfloat16_checkpoint_loads(tmp_path):
    """A checkpoint stored in bfloat16 (how most released models ship) loads: each tensor equals torch's
    bfloat16 values, in float32 or kept in bfloat16."""
    import torch

    model = make_hf_model("qwen2").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    want = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    _, params32 = load_hf_model(tmp_path, param_dtype="float32")
    _, params16 = load_hf_model(tmp_path, param_dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(params32["layers"]["attn"]["q"]["kernel"][1]), want)
    assert params16["layers"]["attn"]["q"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params16["layers"]["attn"]["q"]["kernel"][1], np.float32), want)


def test_unrolled_layer_loop_is_the_same_function():
    """`model.scan_unroll = L` (a straight-line layer loop) computes the scanned decoder's logits and gradients."""
    from jaxrl_llm.models.config import ModelConfig
    from jaxrl_llm.models.decoder import init_params

    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                         num_kv_heads=1, head_dim=8, dtype="bfloat16")
    unrolled = config.replace(scan_unroll=3)
    params = init_params(config, jax.random.key(0))
    tokens, mask = left_padded_batch(64, [6, 4], seed=4)

    def loss(p, c):
        return forward(p, c, jnp.asarray(tokens), jnp.asarray(mask)).astype(jnp.float32).std()

    np.testing.assert_allclose(loss(params, config), loss(params, unrolled), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(jax.grad(loss)(params, config)), jax.tree.leaves(jax.grad(loss)(params, unrolled)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
