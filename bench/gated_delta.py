"""The gated delta rule (Gated DeltaNet, `jaxrl_llm/models/gated_delta.py`), forward + backward, at growing contexts:
our chunked form, our token-by-token form, and transformers' chunked PyTorch reference (`torch_chunk_gated_delta_rule`,
what transformers runs where flash-linear-attention's kernels do not: on a CPU) in one run.

    python bench/gated_delta.py [--tokens 1024,4096,16384] [--heads 4] [--head-dim 128] [--chunk 64] [--repeats 2]
                                [--recurrent-up-to 4096] [--skip-torch]

Each case is `sum(o * w)` over `o = rule(q, k, v, g, beta)` and its gradient with respect to q, k, v, g and beta
(batch 1, float32, the q/k heads equal to the value heads), best of `--repeats` after a compile / warm-up call.
Prints seconds per forward + backward, tokens per second, our chunked form's speed-up over each other, and the
compiled temporaries of our chunked backward (linear in the context: one state per chunk is kept, not one per token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_int_options, best_seconds, cpu_model  # noqa: E402
from jaxrl_llm.models.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402


def inputs(tokens: int, heads: int, dim: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(1, tokens, heads, dim)).astype(np.float32) for _ in range(3))
    g = (-0.1 * np.abs(rng.normal(size=(1, tokens, heads)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(1, tokens, heads))))).astype(np.float32)
    return [q, k, v, g, beta]


def jax_case(rule, arrays: list[np.ndarray], chunk: int) -> tuple[float, int]:
    """(seconds per forward + backward, compiled temporary bytes) of `rule`."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=arrays[2].shape).astype(np.float32))
    kwargs = {"chunk": chunk} if rule is chunked_gated_delta_rule else {}

    def loss(*a: jax.Array) -> jax.Array:
        return jnp.sum(rule(*a, **kwargs)[0] * w)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = [jnp.asarray(a) for a in arrays]
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(fn(*args))
    return best_seconds(lambda: jax.block_until_ready(fn(*args)), REPEATS), temp


def torch_case(arrays: list[np.ndarray], chunk: int) -> float:
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    w = torch.tensor(np.random.default_rng(1).normal(size=arrays[2].shape).astype(np.float32))

    def run() -> None:
        tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
        out, _ = torch_chunk_gated_delta_rule(*tensors, chunk_size=chunk, use_qk_l2norm_in_kernel=True)
        (out * w).sum().backward()

    run()
    return best_seconds(run, REPEATS)


def main() -> None:
    global REPEATS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    add_int_options(parser, {"--heads": 4, "--head-dim": 128, "--chunk": 64, "--repeats": 2,
                             "--recurrent-up-to": 4096})
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()
    REPEATS = args.repeats
    print(f"CPU: {cpu_model()}; heads {args.heads}, head dim {args.head_dim}, chunk {args.chunk}, float32, batch 1")
    print("| tokens | ours, chunked (s) | ours, token by token (s) | transformers, chunked (s) | chunked tokens/s | "
          "vs token by token | vs transformers | chunked backward temporaries (MiB) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in (int(x) for x in args.tokens.split(",")):
        arrays = inputs(t, args.heads, args.head_dim)
        chunked, temp = jax_case(chunked_gated_delta_rule, arrays, args.chunk)
        rec = jax_case(recurrent_gated_delta_rule, arrays, args.chunk)[0] if t <= args.recurrent_up_to else None
        peer = None if args.skip_torch else torch_case(arrays, args.chunk)
        cells = [f"{chunked:.3f}", "-" if rec is None else f"{rec:.3f}", "-" if peer is None else f"{peer:.3f}",
                 f"{t / chunked:,.0f}", "-" if rec is None else f"{rec / chunked:.2f}x",
                 "-" if peer is None else f"{peer / chunked:.2f}x", f"{temp / 2**20:.1f}"]
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)


REPEATS = 2

if __name__ == "__main__":
    main()
