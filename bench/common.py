"""What every benchmark (and the tests) share: the random models they build and one FLOP counter.

Models are plain HF config dicts with `model_type`; `random_hf_model` builds any of them with transformers.
FLOPs count the useful work of the decoder's matmuls and attention (padding excluded):

    N     = L * (d*q + 2*d*kv + q*d + 3*d*f)                      the layers' matrix parameters
    one position with `s` keys in its context:  2 N + 4 L q s    (q = heads * head_dim: QK^T and PV)
    unembedding:                                2 d V per position that produces logits

`forward_flops` sums these over a sequence; training is 3 x forward (forward + backward), a GRPO update with
a reference pass is 4 x forward, one sampling call is the prompt's prefill plus one position per new token.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Random Qwen2 with the stories260K tokenizer's 512 tokens (bench/grpo_vs_trl.py, the TRL comparison).
QWEN2_STORIES_10M: dict[str, Any] = dict(
    model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=10,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=1, eos_token_id=2,
)
# Random Qwen2 with an 8192-token vocabulary (bench/sampling.py, the HF generate comparison).
QWEN2_VOCAB8K_10M: dict[str, Any] = dict(
    model_type="qwen2", vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
)
# Qwen2.5-0.5B's shape (bench/gpu_step.py), and a seconds-long smoke-test version of it.
QWEN25_05B: dict[str, Any] = dict(
    model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6,
)
QWEN25_05B_TINY: dict[str, Any] = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "vocab_size": 512}


def add_int_options(parser: argparse.ArgumentParser, defaults: dict[str, int]) -> None:
    """Integer options without help of their own (a benchmark's sizes and repeats): `{"--new-tokens": 64}` is
    `--new-tokens`, default 64. The flags are written out as a user types them (the docs' commands are checked
    against the scripts' text)."""
    for flag, default in defaults.items():
        parser.add_argument(flag, type=int, default=default)


def add_switches(parser: argparse.ArgumentParser, helps: dict[str, str]) -> None:
    """On/off options (`store_true`), each flag with its help: `{"--bf16": "bfloat16 compute"}`."""
    for flag, help_text in helps.items():
        parser.add_argument(flag, action="store_true", help=help_text)


ROUTER_WEIGHTS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")


def random_hf_model(config: dict[str, Any], seed: int = 0, *, eager: bool = False,
                    random_norms_and_biases: bool = False, out_dir: str | Path | None = None) -> Any:
    """A transformers causal LM with random weights (torch, float32, eval mode) from a config dict with
    `model_type`; `eager` attention (what parity tests compare against); `random_norms_and_biases` also
    randomises RMSNorm scales (around 1) and biases, so a converter that drops or swaps them fails; saved to
    `out_dir` if given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(config)
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    extra = {"attn_implementation": "eager"} if eager else {}
    if eager:
        hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **extra).eval()
    if random_norms_and_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif name.endswith(ROUTER_WEIGHTS):  # an MoE router: logits far apart, so top-k has no near-ties
                    p.mul_(30.0)
                elif name.endswith("self_attn.sinks"):  # gpt-oss: sinks the size of the scores, so they matter
                    p.copy_(torch.randn_like(p))
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def model_dims(config: Any) -> dict[str, int]:
    """`d, f, layers, q (= heads * head_dim), vocab, n_layers` (the layers' matrix parameters) of a `ModelConfig`,
    an HF config dict, or an HF model directory."""
    if isinstance(config, str | Path):
        import json

        config = json.loads((Path(config) / "config.json").read_text())
    if isinstance(config, dict):
        d, heads = config["hidden_size"], config["num_attention_heads"]
        hd = config.get("head_dim") or d // heads
        f, layers, kvh, vocab = (config["intermediate_size"], config["num_hidden_layers"],
                                 config["num_key_value_heads"], config["vocab_size"])
    else:
        d, f, hd, heads, kvh = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_heads,
                                config.num_kv_heads)
        layers, vocab = config.num_layers, config.vocab_size
    q, kv = heads * hd, kvh * hd
    return dict(d=d, f=f, layers=layers, q=q, vocab=vocab, n_layers=layers * (d * q + 2 * d * kv + q * d + 3 * d * f))


def forward_flops(dims: dict[str, int], contexts: np.ndarray | list[float], logits_positions: float) -> float:
    """One sequence's forward: `2 N + 4 L q s` per position with `s` keys in its context (`contexts`), plus
    the unembedding of `logits_positions` positions."""
    contexts = np.asarray(contexts, np.float64)
    return float(2 * dims["n_layers"] * len(contexts) + 4 * dims["layers"] * dims["q"] * contexts.sum()
                 + 2 * dims["d"] * dims["vocab"] * logits_positions)


def sequence_flops(dims: dict[str, int], prompt_len: int, completion_len: float) -> float:
    """Forward over `prompt + completion[:-1]` (`S = P + C - 1` positions, contexts 1..S), logits for the `C`
    completion positions: what the train step and the reference pass compute per row."""
    s = prompt_len + completion_len - 1
    # sum_{k=1..S} k = S (S + 1) / 2, also for a fractional mean completion length
    return 2 * dims["n_layers"] * s + 4 * dims["layers"] * dims["q"] * s * (s + 1) / 2 \
        + 2 * dims["d"] * dims["vocab"] * completion_len


def train_flops(dims: dict[str, int], rows: int, prompt_len: int, completion_len: float) -> float:
    """Forward + backward (3 x forward) of `rows` sequences."""
    return 3 * rows * sequence_flops(dims, prompt_len, completion_len)


def update_flops(dims: dict[str, int], rows: int, prompt_len: int, completion_len: float) -> float:
    """A GRPO update with a reference pass: reference forward + policy forward and backward (4 x forward)."""
    return 4 * rows * sequence_flops(dims, prompt_len, completion_len)


def sampling_flops(dims: dict[str, int], rows: int, prompt_len: int, new_tokens: int) -> float:
    """One sampling call: the prompt's positions (contexts 1..P) and one position per new token after the first
    (contexts P+1 .. P+T-1), each producing logits (as the sampler's useful work is counted)."""
    contexts = np.concatenate([np.arange(1, prompt_len + 1), prompt_len + np.arange(1, new_tokens)])
    return rows * forward_flops(dims, contexts, len(contexts))


def cpu_model() -> str:
    """lscpu's model name (every figure names the CPU it ran on)."""
    import platform
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The shortest wall time of `repeats` calls of `fn` (which returns once its work is done)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def jax_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 50) -> float:
    """FLOP/s of a jitted `[size, size] @ [size, size]` in `dtype` (best of `repeats`): the practical limit."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    matmul(a, a).block_until_ready()
    return 2 * size**3 / best_seconds(lambda: matmul(a, a).block_until_ready(), repeats)


def torch_matmul_flops(dtype: str = "float32", size: int = 1024, repeats: int = 50) -> float:
    """The same for `torch.mm` (the peers' limit on this machine)."""
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    torch.mm(a, a)
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, a), repeats)
