"""Helpers the tests share: tiny random Hugging Face models of each family (built locally, no network), tiny
runs of the CLI's config on the arithmetic task, the readers of a run's files, and the paths of ../shared."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.engine import Engine
from jaxrl_llm.models.decoder import forward, init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.trainers.objectives import PolicyBatch

# Compilation dominates a cold run of the suite (tiny models, many distinct programs): LLVM's cheaper settings
# cut it by about a quarter, and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters by
# another third (a tiny GRPO update compiled in 3.3 s -> 1.6-2.0 s, the sampler 2.1 s -> 1.1-1.6 s); matmuls
# still call the same library kernels. XLA reads XLA_FLAGS when the first backend starts, not at `import jax`.
# Subprocesses that set their own XLA_FLAGS (virtual devices) add these.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")

# XLA:CPU runs each virtual device's program on its own thread and meets the others at each collective; a thread
# that waits more than 40 s (the default) for the rest aborts the process. With 8 virtual devices on 2 cores beside
# a second pytest-xdist worker one device can lag that long (CI, AVX2-only EPYC: the ring-attention parity test
# died at its first collective-permute, 7 of 8 threads there). A real deadlock still ends the run: after 300 s,
# inside each subprocess's 600 s timeout, with XLA's message naming the collective.
PATIENT_COLLECTIVES_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=300"


def virtual_devices_xla_flags(devices: int, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a subprocess on `devices` virtual CPU devices: patient collectives, and the suite's cheaper
    compile settings unless `fast_compile` is off (a test that measures the optimised program's memory)."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}", PATIENT_COLLECTIVES_FLAGS,
                     *([FAST_COMPILE_FLAGS] if fast_compile else [])])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES260K = SHARED / "models" / "stories260K"
GSM8K = SHARED / "data" / "gsm8k"

# Tiny configs of each supported family; each exercises that family's switches.
_COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", rope_theta=10000.0, **_COMMON),
    "llama3_rope": dict(
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        **_COMMON,
    ),
    "llama_linear_rope_bias": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="linear", factor=2.0),
        attention_bias=True,
        mlp_bias=True,
        **_COMMON,
    ),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, **_COMMON),
    "qwen3": dict(model_type="qwen3", head_dim=16, **_COMMON),
    "mistral": dict(model_type="mistral", sliding_window=4, head_dim=8, **_COMMON),
    "llama_yarn": dict(
        model_type="llama",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0),
        **_COMMON,
    ),
    # Phi-3: fused qkv_proj / gate_up_proj, a sliding window on every layer.
    "phi3": dict(model_type="phi3", sliding_window=6, pad_token_id=None, **_COMMON),
    # Phi-3.5-style longrope past an original context of 16, with Phi-4-mini's partial rotary (half the dims).
    "phi3_longrope": dict(
        model_type="phi3",
        pad_token_id=None,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=16,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.3], long_factor=[2.5, 7.0]),
        **_COMMON,
    ),
    # Gemma 2: (1 + w) norms, sandwich norms, GeGLU, sqrt(d) embeddings, soft caps small enough to bite,
    # query_pre_attn_scalar != head_dim, sliding window 4 on layers 0, 2, ...
    "gemma2": dict(
        model_type="gemma2", head_dim=16, sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=6.0, initializer_range=0.2, **{**_COMMON, "num_hidden_layers": 3},
    ),
    # Gemma 3 (text): q/k norms, local layers (window 5, RoPE base 100) around one global layer (linear-scaled).
    "gemma3": dict(
        model_type="gemma3_text", head_dim=16, sliding_window=5, query_pre_attn_scalar=16, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=10000.0,
        rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=2.0),
        **{**_COMMON, "num_hidden_layers": 3},
    ),
    # Mixtures of experts (8 experts, top 2; routers sharpened by `random_hf_model` so top-k has no near-ties):
    # Qwen3-MoE with renormalized top-k, Qwen2-MoE's shared expert and q/k/v biases, Mixtral's names and window,
    # OLMoE's projection-wide q/k norms.
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, moe_intermediate_size=24, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, **_COMMON),
    "qwen2_moe": dict(model_type="qwen2_moe", moe_intermediate_size=24, shared_expert_intermediate_size=40,
                      num_experts=8, num_experts_per_tok=2, **_COMMON),
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, sliding_window=5, **_COMMON),
    "olmoe": dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, pad_token_id=0, eos_token_id=None,
                  **_COMMON),
    # gpt-oss: attention sinks, sliding window 4 on layers 0 and 2, YaRN without truncation, a biased router, biased
    # experts with a clamped SwiGLU whose limit (0.3) bites on these activations (beta_slow 0.1: a ramp end that
    # truncation would round, so the flag matters at head_dim 8).
    "gpt_oss": dict(model_type="gpt_oss", head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                    swiglu_limit=0.3,
                    rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=8.0,
                                      beta_slow=0.1, truncate=False),
                    **{**_COMMON, "num_hidden_layers": 3, "intermediate_size": 24}),
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def make_hf_model(kind: str, seed: int = 0):
    """A random transformers causal LM of family `kind` (torch, float32, eager attention, random norms and
    biases so a converter that drops or swaps them fails): `bench/common.py`'s builder, shared with the
    benchmarks."""
    from bench.common import random_hf_model

    return random_hf_model(FAMILIES[kind], seed, eager=True, random_norms_and_biases=True)


def left_padded_batch(vocab_size: int, lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask `[B, max(lengths)]`, rows left-padded (pad id 0) to different lengths."""
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, t - n :] = rng.integers(1, vocab_size, n)
        mask[i, t - n :] = 1
    return tokens, mask


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits for a left-padded batch with positions from the mask (as generate does)."""
    import torch

    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def requires_shared(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not path.exists(), reason=f"{path} is absent (a clone without ../shared); real-checkpoint test skipped"
    )


def assert_jit_vmap_agree(fn, *args) -> None:
    """``jit(fn)`` equals eager ``fn``; ``jit(vmap(fn))`` over 3 perturbed copies equals per-copy results."""
    jitted = jax.jit(fn)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), jitted(*args), fn(*args))
    copies = [
        jax.tree.map(lambda a, k=k: a * (1 + 0.1 * k) if jnp.issubdtype(a.dtype, jnp.floating) else a, args)
        for k in range(3)
    ]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *copies)
    batched = jax.jit(jax.vmap(fn))(*stacked)
    for k, c in enumerate(copies):
        jax.tree.map(lambda a, b, k=k: np.testing.assert_allclose(a[k], b, rtol=1e-5, atol=1e-6), batched, jitted(*c))


# ------------------------------------------------------------------------------------ tiny runs and their outputs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# The one shape of a tiny run: a rollout of 4 prompts x 4 samples, 16 held-out problems scored in one batch,
# few steps. Tests that do not depend on these values keep them, so each compiled program (sampler, update,
# evaluation) is compiled once and then served by the persistent compile cache to every other file.
TINY_SHAPE = ("steps=1", "rl.prompts_per_step=4", "rl.group_size=4", "eval_size=16", "eval_batch_size=16")
# Nothing a test does not look at: no progress bar, TensorBoard events, export or HTML report.
QUIET = ("progress_bar=false", "tensorboard=false", "export=false", "report=false")


FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def assert_within_rounding(got: Any, want: Any, terms: int) -> None:
    """Two float32 programs meant to compute the same values, in sums of at most `terms` rounded additions each,
    agree to their rounding: |got - want| <= 2 terms u max|want| (u = 2^-24; 2: both round; the recursive
    summation bound n u sum|x_i|, with the largest value standing in for the sum of the terms' magnitudes). Where
    XLA fuses the two differently, they are bit-equal on one CPU class and a few u apart on another."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = 2 * terms * FLOAT32_UNIT_ROUNDOFF * np.abs(want).max()
    worst = np.abs(got - want).max()
    assert worst <= bound, f"off by {worst:.3g} > {bound:.3g} (2 x {terms} x u x max|want|)"


def tiny_run_args(out: Path, *overrides: str, task: Path | None = None) -> list[str]:
    """`key=value` arguments (for `train.py`, `train.cli` or `load_run_config`) of a tiny quiet run into `out`:
    `task`'s model, train and held-out data when given (the `tiny_task` fixture's layout), TINY_SHAPE, QUIET,
    then `overrides`, which win (e.g. `data.eval=` for no held-out set, `export=true`)."""
    data = [] if task is None else [f"model.path={task / 'model'}", f"data.train={task / 'train.jsonl'}",
                                    f"data.eval={task / 'test.jsonl'}"]
    return [*data, f"out_dir={out}", *TINY_SHAPE, *QUIET, *overrides]


def tiny_run(preset: str | None, out: Path, *overrides: str, task: Path | None = None, **kwargs):
    """The RunConfig of a tiny run of `configs/<preset>` (None: the built-in defaults) into `out`, with
    `tiny_run_args`; `kwargs` (algo=, rewards=) go to `load_run_config`."""
    from jaxrl_llm.config import load_run_config

    path = None if preset is None else CONFIGS / (preset if preset.endswith(".yaml") else f"{preset}.yaml")
    return load_run_config(path, tiny_run_args(out, *overrides, task=task), **kwargs)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_rows(run: Path, having: str | None = None) -> list[dict]:
    """The rows of `run/metrics.jsonl`; with `having`, only those that log that metric (e.g. "reward/mean": the
    training steps, not the evaluation-only rows)."""
    return [r for r in _jsonl(run / "metrics.jsonl") if having is None or having in r]


def read_samples(run: Path) -> list[dict]:
    """The rows of `run/samples.jsonl`."""
    return _jsonl(run / "samples.jsonl")


def read_summary(run: Path) -> dict:
    """`run/summary.json`."""
    return json.loads((run / "summary.json").read_text())


# A tiny Llama for trainer tests (with the arithmetic task's tokenizer).
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """`clipped_policy_loss`'s keywords from a flat dict: the `PolicyLossOptions` fields among them as `options=`."""
    from jaxrl_llm.rl import PolicyLossOptions

    names = {f.name for f in dataclasses.fields(PolicyLossOptions)}
    options = {k: v for k, v in keywords.items() if k in names}
    return {**{k: v for k, v in keywords.items() if k not in names}, "options": PolicyLossOptions(**options)}


PAD = 0  # the pad id of the left-padded batches


def hf_generate(model, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, eos_ids=None) -> np.ndarray:
    """transformers' greedy `generate` on a left-padded batch: completions `[B, new_tokens]`, 0-padded."""
    import torch

    model.generation_config.eos_token_id = eos_ids  # None: never stop early
    with torch.no_grad():
        out = model.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=PAD,
        )
    completions = out[:, tokens.shape[1] :].numpy()
    return np.pad(completions, ((0, 0), (0, new_tokens - completions.shape[1])), constant_values=PAD)


forward_jit = jax.jit(forward, static_argnums=1)


def fresh_logits(params, config, prompt_tokens, prompt_mask, out, n: int) -> np.ndarray:
    """A plain forward pass over prompt + completion: the logits that predict each completion token."""
    prompts = np.repeat(prompt_tokens, n, axis=0)
    masks = np.repeat(prompt_mask, n, axis=0)
    tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    mask = np.concatenate([masks, np.asarray(out.mask)], axis=1)
    logits = forward_jit(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    p = prompt_tokens.shape[1]
    return np.asarray(logits[:, p - 1 : p - 1 + out.tokens.shape[1]], np.float32)


def gather_logprobs(logprobs: np.ndarray, tokens) -> np.ndarray:
    return np.take_along_axis(logprobs, np.asarray(tokens)[..., None], axis=-1)[..., 0]


def small_engine(config, **overrides) -> Engine:
    """Small pages, fewer slots than rows and few steps per call, so admission, refills and page growth all run."""
    settings = dict(num_pages=96, page_size=4, slots=3, steps_per_call=5, prefill_chunk=8, prefill_rows=2)
    return Engine(config, **{**settings, **overrides})


def fixed_batch(config, n=8, p=6, t=5, seed=0):
    rng = np.random.default_rng(seed)
    pt = rng.integers(3, config.vocab_size, (n, p)).astype(np.int32)
    pm = np.ones((n, p), np.int32)
    pm[: n // 2, :2] = 0
    ct = rng.integers(3, config.vocab_size, (n, t)).astype(np.int32)
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]).astype(np.int32)
    adv = rng.normal(size=n).astype(np.float32)
    return pt, pm, ct, cm, adv


def fixed_update_setup():
    """A tiny random model, a fixed policy batch whose old log-probs are the model's own, and AdamW at 0.05."""
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.trainers.objectives import completion_logprobs

    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(1))
    pt, pm, ct, cm, adv = fixed_batch(config)
    old = completion_logprobs(params, config, pt, pm, ct, cm)[0]
    optimizer, _ = make_optimizer(OptimSection(learning_rate=0.05, max_grad_norm=0.0), 10)
    return config, params, PolicyBatch(pt, pm, ct, cm, old, jnp.zeros_like(old), adv), optimizer


_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[")


_COMPILED_DOT = re.compile(r"= \w+\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")


def compiled_dot_operand_types(compiled_text: str) -> list[tuple[str, str]]:
    """Element types of both operands of every dot in a compiled XLA module (fusion bodies included): what the
    backend runs, after its passes, which the lowered program does not show."""
    types = dict(_DEFINITION.findall(compiled_text))
    return [(types[a], types[b]) for a, b in _COMPILED_DOT.findall(compiled_text)]


def completion_length(prompts, completions, **fields):
    """A reward that differs within a group of a random model's completions (the tiny model rarely adds
    right, so math_answer alone can leave every group at 0 and the policy unmoved): their length / 8."""
    return [len(c) / 8 for c in completions]


def starts_with_seven(prompts, completions, **fields):
    """A trivially learnable reward: the completion starts with the digit 7."""
    return [float(c.startswith("7")) for c in completions]


def random_rollout(params: Any, config: Any, rng: np.random.Generator, n: int, p_len: int, t_len: int,
                   vocab: int = 32) -> tuple[np.ndarray, ...]:
    """`n` random left-padded prompts (2 to `p_len` tokens) and right-padded completions (1 to `t_len` tokens) of
    ids below `vocab`, and the model's log-probs of the completions: `(pt, pm, ct, cm, logp)`."""
    from jaxrl_llm.trainers.objectives import completion_logprobs

    pm = (np.arange(p_len)[None] >= p_len - rng.integers(2, p_len + 1, n)[:, None]).astype(np.int32)
    pt = np.where(pm, rng.integers(1, vocab, (n, p_len)), 0).astype(np.int32)
    cm = (np.arange(t_len)[None] < rng.integers(1, t_len + 1, n)[:, None]).astype(np.int32)
    ct = np.where(cm, rng.integers(1, vocab, (n, t_len)), 0).astype(np.int32)
    return pt, pm, ct, cm, np.asarray(completion_logprobs(params, config, pt, pm, ct, cm)[0])


def assert_config_refused(overrides: list[str], match: str) -> None:
    """Loading a config with these command-line `overrides` fails with a `ConfigError` whose line matches `match`."""
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.preflight import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
