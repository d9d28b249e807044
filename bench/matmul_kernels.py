"""Which XLA kernel each dtype combination of a matmul hits on this machine: GFLOP/s of a jitted `jnp.dot`.

    python bench/matmul_kernels.py

Per shape (the update's `[rows, 576] x [576, 1536]`-like GEMMs and the decode step's 32-row ones): float32, bf16
operands with a bf16 result (`x @ w`), and bf16 operands with a float32 result (`preferred_element_type`, what
`jaxrl_llm.models.precision` asks for). Best of 50 calls (300 for the 32-row shapes), random operands. Prints a
markdown table (bench/README.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from common import best_seconds

SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024), (32, 576, 1536), (32, 1536, 576)]


def gflops(m: int, k: int, n: int, dtype: jnp.dtype, out: jnp.dtype | None) -> float:
    """GFLOP/s of `[m, k] @ [k, n]` with operands in `dtype` and result `out` (None: the operands' dtype)."""
    x = jax.random.normal(jax.random.key(0), (m, k)).astype(dtype)
    w = (jax.random.normal(jax.random.key(1), (k, n)) * 0.02).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=out))
    f(x, w).block_until_ready()
    return 2 * m * k * n / best_seconds(lambda: f(x, w).block_until_ready(), 50 if m >= 1024 else 300) / 1e9


def main() -> None:
    print(f"jax {jax.__version__}, {jax.devices()}")
    print("| shape (M x K x N) | float32 | bf16 in, bf16 out | bf16 in, float32 out |")
    print("| --- | ---: | ---: | ---: |")
    for m, k, n in SHAPES:
        rates = [gflops(m, k, n, jnp.float32, None), gflops(m, k, n, jnp.bfloat16, None),
                 gflops(m, k, n, jnp.bfloat16, jnp.float32)]
        print(f"| {m} x {k} x {n} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
