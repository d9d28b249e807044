"""Which XLA kernel each dtype combination of a matmul hits on this machine: GFLOP/s of a jitted `jnp.dot`.

    python bench/matmul_kernels.py                      the table of bench/README.md
    python bench/matmul_kernels.py --shape 64x64x64 --calls 3      one small shape, few calls (the smoke test)

Per shape (the update's `[rows, 576] x [576, 1536]`-like GEMMs and the decode step's 32-row ones): float32, bf16
operands with a bf16 result (`x @ w`), and bf16 operands with a float32 result (`preferred_element_type`, what
`jaxrl_llm.models.precision` asks for). Best of 50 calls (300 for the 32-row shapes), random operands. Prints a
markdown table (bench/README.md).

Then the weight gradient of the same shapes, `x^T g` (`[M, K]^T [M, N] -> [K, N]`, bf16 operands, float32 result):
as `jnp.einsum("ik,in->kn")` writes it, and as `precision.float32_dot` lays it out (the update's backward).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not
from bench.common import best_seconds  # noqa: E402
from jaxrl_llm.models import precision  # noqa: E402

SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024), (32, 576, 1536), (32, 1536, 576)]


def gflops(m: int, k: int, n: int, dtype: jnp.dtype, out: jnp.dtype | None, calls: int | None = None) -> float:
    """GFLOP/s of `[m, k] @ [k, n]` with operands in `dtype` and result `out` (None: the operands' dtype)."""
    x = jax.random.normal(jax.random.key(0), (m, k)).astype(dtype)
    w = (jax.random.normal(jax.random.key(1), (k, n)) * 0.02).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=out))
    f(x, w).block_until_ready()
    calls = calls or (50 if m >= 1024 else 300)
    return 2 * m * k * n / best_seconds(lambda: f(x, w).block_until_ready(), calls) / 1e9


def weight_gradient_gflops(m: int, k: int, n: int, laid_out: bool, calls: int | None = None) -> float:
    """GFLOP/s of `x^T g` for `x [m, k]`, `g [m, n]` in bf16 with a float32 result: `jnp.einsum` as written, or
    `precision.float32_dot` (`laid_out`)."""
    x = jax.random.normal(jax.random.key(0), (m, k)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(1), (m, n)).astype(jnp.bfloat16)
    if laid_out:
        f = jax.jit(lambda a, b: precision.float32_dot("ik,in->kn", a, b, jnp.bfloat16))
    else:
        f = jax.jit(lambda a, b: jnp.einsum("ik,in->kn", a, b, preferred_element_type=jnp.float32))
    f(x, g).block_until_ready()
    calls = calls or (50 if m >= 1024 else 300)
    return 2 * m * k * n / best_seconds(lambda: f(x, g).block_until_ready(), calls) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", default=[], metavar="MxKxN", help="instead of the default shapes")
    parser.add_argument("--calls", type=int, default=None, help="best of this many calls (default: 50 / 300)")
    args = parser.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shape] or SHAPES
    print(f"jax {jax.__version__}, {jax.devices()}")
    print("| shape (M x K x N) | float32 | bf16 in, bf16 out | bf16 in, float32 out |")
    print("| --- | ---: | ---: | ---: |")
    for m, k, n in shapes:
        rates = [gflops(m, k, n, jnp.float32, None, args.calls), gflops(m, k, n, jnp.bfloat16, None, args.calls),
                 gflops(m, k, n, jnp.bfloat16, jnp.float32, args.calls)]
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |")
    print()
    print("| weight gradient x^T g (M x K x N) | jnp.einsum | precision.float32_dot |")
    print("| --- | ---: | ---: |")
    for m, k, n in shapes:
        rates = [weight_gradient_gflops(m, k, n, laid_out, args.calls) for laid_out in (False, True)]
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
