"""Model families beyond Llama: Phi-3 (fused projections, longrope, partial rotary), Gemma 2 and Gemma 3 (text),
and the RoPE scalings (llama3, linear, yarn, longrope) beyond their original context.

Logit parity at short lengths and greedy parity with `generate` (40 new tokens, past every window and original
context) run for every family (`FAMILIES`: models/test_decoder.py, sampling/test_sampler.py); here: long sequences, what
each switch changes, the export round trip, one GRPO step and the planner's parameter count per family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.decoder import forward
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.hf_export import save_hf_model
from tests.families import FAMILIES, hf_logits, left_padded_batch, make_hf_model, one_per_model_type
from tests.runs import read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=20)

# Rows of 40 tokens: past the original context (16) of the scaled RoPEs and every sliding window (4-6).
LONG = [40, 25, 6, 40]


def _max_diff(ours, ref, mask) -> float:
    valid = mask.astype(bool)
    return float(np.abs(np.asarray(ours, np.float32)[valid] - ref[valid]).max())


def test_every_supported_model_type_has_a_tiny_family():
    """FAMILIES (tests/families.py) drives every per-family test (parity, export, the planner, the GRPO step, the
    engine), so a model type the converter accepts without a tiny config there would be tested by none of them."""
    from jaxrl_llm.models.hf_config import SUPPORTED_MODEL_TYPES

    assert sorted({hf["model_type"] for hf in FAMILIES.values()}) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logit_parity_beyond_windows_and_original_context(kind, hf_model_dir):
    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, LONG, seed=4)
    ref = hf_logits(make_hf_model(kind), tokens, mask)
    assert _max_diff(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)), ref, mask) <= 1e-4


def test_family_switches_are_read_and_matter(hf_model_dir):
    """Each new switch reaches ModelConfig and changes the logits when removed (parity cannot pass by luck)."""
    tokens, mask = left_padded_batch(97, LONG, seed=5)

    def logits(config, params):
        return np.asarray(forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))

    gemma2, params2 = load_hf_model(hf_model_dir("gemma2"))
    assert gemma2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (gemma2.sliding_window, gemma2.query_pre_attn_scalar) == (4, 24.0)
    assert gemma2.norm_unit_offset and gemma2.embed_scale and gemma2.sandwich_norms
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings
    base = logits(gemma2, params2)
    for change in (dict(attn_logit_softcap=None), dict(final_logit_softcap=None), dict(query_pre_attn_scalar=None),
                   dict(layer_types=("full_attention",) * 3), dict(hidden_act="silu")):
        assert np.abs(logits(gemma2.replace(**change), params2) - base).max() > 1e-3, change

    gemma3, params3 = load_hf_model(hf_model_dir("gemma3"))
    assert gemma3.qk_norm and gemma3.local_rope_theta == 100.0 and gemma3.rope_theta == 10000.0
    assert dict(gemma3.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    base = logits(gemma3, params3)
    for change in (dict(local_rope_theta=None), dict(rope_scaling=None)):
        assert np.abs(logits(gemma3.replace(**change), params3) - base).max() > 1e-3, change

    phi3, params_phi = load_hf_model(hf_model_dir("phi3_longrope"))
    scaling = dict(phi3.rope_scaling)
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 16
    assert phi3.partial_rotary_factor == 0.5
    # Long factors only past the original context: a short batch sees the short factors alone.
    short_tokens, short_mask = left_padded_batch(97, [12, 7], seed=6)
    only_short = phi3.replace(rope_scaling=tuple({**scaling, "long_factor": scaling["short_factor"]}.items()))
    for cfg_tokens, cfg_mask, differs in ((short_tokens, short_mask, False), (tokens, mask, True)):
        a = forward(params_phi, phi3, jnp.asarray(cfg_tokens), jnp.asarray(cfg_mask))
        b = forward(params_phi, only_short, jnp.asarray(cfg_tokens), jnp.asarray(cfg_mask))
        assert (float(jnp.abs(a - b).max()) > 1e-3) == differs


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_export_round_trip_through_transformers(kind, hf_model_dir, tmp_path):
    """import -> export -> transformers loads it -> the same logits, and the same config back; every tensor comes
    back under its name, bit-exact (Phi-3's fused qkv_proj / gate_up_proj, the experts of each MoE layout)."""
    from transformers import AutoModelForCausalLM

    source = hf_model_dir(kind)
    config, params = load_hf_model(source)
    out = save_hf_model(params, config, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens, mask = left_padded_batch(config.vocab_size, LONG, seed=3)
    original = hf_logits(make_hf_model(kind), tokens, mask)
    assert _max_diff(hf_logits(reloaded, tokens, mask), original, mask) <= 1e-5
    assert load_hf_model(out)[0] == config
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)  # same tensor names: fused qkv_proj / gate_up_proj for Phi-3
    for name, tensor in before.items():
        np.testing.assert_array_equal(after[name], tensor, err_msg=name)


def test_refusals_name_the_reason_and_the_supported_families(hf_model_dir, tmp_path):
    for model_type, arch, reason in (("deepseek_v3", "DeepseekV3ForCausalLM", "latent attention"),
                                     ("gemma3", "Gemma3ForConditionalGeneration", "gemma3_text")):
        model_dir = tmp_path / model_type
        shutil.copytree(hf_model_dir("llama"), model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config.update(model_type=model_type, architectures=[arch])
        (model_dir / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConversionError, match=rf"{reason}.*phi3, gemma2, gemma3_text"):
            load_hf_model(model_dir)


@pytest.fixture(scope="module")
def family_task(tiny_task, tmp_path_factory):
    """`family_task(kind)`: a random model of family `kind` with the arithmetic tokenizer's vocabulary."""
    from bench.common import random_hf_model

    def build(kind: str) -> Path:
        root = tmp_path_factory.mktemp(f"task_{kind}")
        vocab = json.loads((tiny_task / "model" / "config.json").read_text())["vocab_size"]
        random_hf_model({**FAMILIES[kind], "vocab_size": vocab, "eos_token_id": 2, "bos_token_id": 1},
                        out_dir=root)
        for f in (tiny_task / "tok").iterdir():
            shutil.copy(f, root / f.name)
        return root

    return build


@pytest.mark.parametrize("kind", one_per_model_type())
def test_one_grpo_step_runs(kind, family_task, tiny_task, tmp_path):
    from jaxrl_llm.trainers import make_trainer

    model = family_task(kind)
    out = tmp_path / "run"
    config = tiny_run("grpo_arithmetic", out, f"model.path={model}", "data.eval=''", "rl.beta=0.04",
                      "sampling.max_new_tokens=8", "checkpoint_every=0", "export=true", "optim.warmup_steps=0",
                      "rewards=[{name: 'tests.runs:completion_length'}]", task=tiny_task)
    make_trainer(config).run()
    row = read_rows(out, "policy_loss")[-1]
    assert all(np.isfinite(row[k]) for k in ("policy_loss", "grad_norm", "entropy", "kl")) and row["grad_norm"] > 0
    exported = next(p for p in out.rglob("config.json") if p.parent != out)
    _, before = load_hf_model(model)
    _, after = load_hf_model(exported.parent)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), before, after)
    assert max(jax.tree.leaves(moved)) > 0  # the step changed the weights, and the export carries them


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_planner_knows_the_family(kind, hf_model_dir, capsys):
    """`python -m jaxrl_llm plan` on each family: its parameter count equals transformers' model's."""
    from jaxrl_llm.cli.plan import main

    assert main(["--model", str(hf_model_dir(kind)), "--batch", "2", "--prompt-len", "16", "--new-tokens", "16",
                 "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    hf_count = sum(p.numel() for p in make_hf_model(kind).parameters())
    config = load_hf_model(hf_model_dir(kind))[0]
    assert config.num_params() == hf_count
    assert f"{config.model_type}, {hf_count / 1e6:,.2f}M params" in text, text


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_sampler_logprobs_match_generate_past_windows_and_the_longrope_switch(kind, hf_model_dir):
    """32 greedy tokens after prompts of 12 and 9: the tokens equal `generate`'s and each token's log-prob equals
    `log_softmax` of transformers' step logits (<= 1e-4), through the sliding windows (4-6) and, for longrope,
    the step where the batch passes the original context (16) and transformers recomputes its cache with the
    long factors (our sampler re-rotates the cached keys: without that, Phi-3 differs by ~7e-4 here)."""
    import torch

    from jaxrl_llm.sampling import SamplingConfig, sample

    config, params = load_hf_model(hf_model_dir(kind))
    tokens, mask = left_padded_batch(config.vocab_size, [12, 9], seed=11)
    model = make_hf_model(kind)
    model.generation_config.eos_token_id = None  # never stop early (Gemma's default EOS is token 1)
    with torch.no_grad():
        out = model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask), do_sample=False,
                             max_new_tokens=32, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[:, tokens.shape[1]:].numpy()
    step_logprobs = np.stack([torch.log_softmax(step.float(), -1).numpy() for step in out.logits], axis=1)
    expected_logprobs = np.take_along_axis(step_logprobs, expected[..., None], axis=-1)[..., 0]
    ours = sample(params, config, tokens, mask, jax.random.key(0), SamplingConfig(max_new_tokens=32, greedy=True))
    np.testing.assert_array_equal(np.asarray(ours.tokens), expected)
    assert float(np.abs(np.asarray(ours.logprobs_untruncated) - expected_logprobs).max()) <= 1e-4


def test_a_sequence_axis_on_a_hybrid_stack_is_refused_in_one_line(family_task, tiny_task, tmp_path):
    """`mesh.sequence=2` with Qwen3.5's linear-attention layers on 2 devices: one line naming the key, exit 2."""
    import os
    import subprocess
    import sys

    from tests.runs import ROOT, tiny_run_args
    from tests.xla_settings import virtual_devices_xla_flags

    args = tiny_run_args(tmp_path / "run", f"model.path={family_task('qwen3_5')}", "data.eval=", "mesh.sequence=2",
                         "mesh.data=1", task=tiny_task)
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(2), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--algo", "grpo", "--config",
                           str(ROOT / "configs" / "grpo_arithmetic.yaml"), *args],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.sequence=2" in lines[0] and "linear-attention layers" in lines[0], lines
