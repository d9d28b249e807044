"""Shared test helpers: tiny random Hugging Face models built locally (no network), ../shared paths."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# The repository root, so tests share bench/common.py (the random-model builder and the FLOP counter).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A persistent XLA compilation cache shared by the suite's processes (in-process runs and the subprocesses
# of the CLI, crash and multi-process tests inherit it): a program compiled once, by any test, loads from
# disk afterwards. Entries are keyed by the program, JAX version and flags, so a stale entry is never used.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "jaxrl_llm_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# One OpenMP thread for torch (the reference models of the parity tests, PEFT, the bench scripts' peers) and
# OpenBLAS, here and in the subprocesses that inherit the environment: the suite runs 2 pytest-xdist workers on
# 2 cores, and each torch process's default of one spinning OpenMP thread per core made them fight. On the
# 2-core machine SmolLM2's 48-token `generate` took 45 s with 2 threads and 4 s with one (the same results).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if "torch" in sys.modules:  # imported before this file (by a plugin): OMP_NUM_THREADS came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Compilation dominates a cold run of the suite (tiny models, many distinct programs): LLVM's cheaper settings
# cut it by about a quarter, and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters by
# another third (a tiny GRPO update compiled in 3.3 s -> 1.6-2.0 s, the sampler 2.1 s -> 1.1-1.6 s); matmuls
# still call the same library kernels. XLA reads XLA_FLAGS when the first backend starts, not at `import jax`.
# Subprocesses that set their own XLA_FLAGS (virtual devices) add these.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

# The quick tier for the inner loop, `python -m pytest -m quick -n 2`: the RL math, the precision policy, model
# parity with transformers, the one-line input errors and the architecture rules (275 tests; the first 259 took
# 1 min 48 s with a cold compile cache and 48 s warm on the 2-core machine). The full suite still runs everything.
QUICK_FILES = ("test_rl_losses.py", "test_rl_advantages.py", "test_rl_estimators.py", "test_rl_kl_control.py",
               "test_rl_logprobs.py", "test_rl_objectives.py", "test_precision.py", "test_models.py",
               "test_input_errors.py", "test_rl_distillation.py", "test_rl_exact_ties.py")


# The files with the longest tests (subprocess runs of train.py and bench/, the 8-device mesh script, the real
# checkpoint, whole training runs), heaviest first, as measured cold on the 2-core machine. They run first:
# pytest-xdist hands each worker runs of consecutive tests, and when these came in alphabetical order a 2-minute
# test could start last and leave the other worker idle until it ended. Each file keeps its own order (a module
# fixture is set up once); the rest of the suite follows in the usual order.
HEAVY_FIRST = ("test_sharding.py", "test_expert_parallel.py", "test_bench.py", "test_grpo.py", "test_smollm2.py",
               "test_multi_turn.py",
               "test_first_hour.py", "test_docs_environments.py", "test_update_memory.py", "test_lora.py",
               "test_reliability.py", "test_model_families.py", "test_sampling.py", "test_dpo.py",
               "test_run_ownership.py", "test_reward_model.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in QUICK_FILES:
            item.add_marker(pytest.mark.quick)
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(HEAVY_FIRST)))  # stable: same order within a file
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


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """`hf_model_dir(kind)` -> directory of a saved tiny random HF model (built once per session)."""
    cache: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"hf_{kind}")
            make_hf_model(kind).save_pretrained(path)
            cache[kind] = path
        return cache[kind]

    return build


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


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    """A random tiny Llama with the arithmetic tokenizer, and small train/test JSONL files."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.models.hf_export import save_hf_model
    from jaxrl_llm.tasks.arithmetic import make_problems, make_tokenizer

    root = tmp_path_factory.mktemp("tiny_task")
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(root / "tok")
    config = config_from_hf({**TINY, "vocab_size": len(tokenizer), "eos_token_id": 2, "bos_token_id": 1})
    save_hf_model(init_params(config, jax.random.key(0)), config, root / "model", tokenizer_dir=root / "tok")
    problems = make_problems(300, seed=5, max_digits=2)
    for name, rows in (("train", problems[:256]), ("test", problems[256:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A random tiny Llama with a small byte-level BPE tokenizer (trained here) and a ChatML chat template,
    like an instruct model's, in a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.models.hf_export import save_hf_model

    root = tmp_path_factory.mktemp("tiny_chat_model")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = [f"user What is {a} + {b}? Reply with the number. assistant {a + b}" for a in range(30) for b in range(9)]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(root / "tok")
    config = config_from_hf({**TINY, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                             "max_position_embeddings": 256})
    save_hf_model(init_params(config, jax.random.key(0)), config, root / "model", tokenizer_dir=root / "tok")
    return root / "model"


def with_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """`clipped_policy_loss`'s keywords from a flat dict: the `PolicyLossOptions` fields among them as `options=`."""
    from jaxrl_llm.rl import PolicyLossOptions

    names = {f.name for f in dataclasses.fields(PolicyLossOptions)}
    options = {k: v for k, v in keywords.items() if k in names}
    return {**{k: v for k, v in keywords.items() if k not in names}, "options": PolicyLossOptions(**options)}
