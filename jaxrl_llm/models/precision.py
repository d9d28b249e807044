"""The precision policy, stated once: how every weight matmul of the model is done.

::

    operands      the compute dtype (`model.dtype`, e.g. bfloat16), cast here, just before the dot
    accumulation  float32 (`preferred_element_type=float32`)
    output        the backend's fast path: float32 on XLA:CPU, the compute dtype elsewhere
    activations   (residual stream, norms, rotary, softmax, silu) the same dtype as the output
    backward      the same policy: the output's cotangent is cast to the compute dtype, both gradient dots
                  accumulate and return float32 (then the operands' own dtypes)

Why the output dtype depends on the backend (measured on this project's CPU, jax 0.10.2, bench/README.md): an
XLA:CPU dot of bfloat16 operands that *returns* bfloat16 takes a slow path (274 GFLOP/s at 2048 x 576 x 1536,
below float32's 294); the same dot asked for a float32 result runs on the CPU's AMX units (1,804 GFLOP/s;
`python bench/matmul_kernels.py`). Its elementwise work is also faster in float32 than in bfloat16. On GPUs a
bfloat16 GEMM accumulates in float32 in cuBLAS and writes bfloat16, and bfloat16 activations halve the memory
traffic of the elementwise work.

Under float32 (`model.dtype=float32`) every function here is the plain float32 dot it always was.

`matmul(x, w, dtype)` is the one function that multiplies by a weight (`Dense`, the token step's fused
projections, the unembedding, the scalar heads, LoRA); `einsum` serves attention's `q.k` and `p.v`.
A test reads the lowered HLO of the model, the token step, the log-prob path and the train step's gradient
and fails on any dot that is not bf16 x bf16 -> float32 under `model.dtype=bfloat16`.
"""

from __future__ import annotations

import functools
import platform as host_platform
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

Array = jax.Array
WEIGHT_MATMUL = "weight_matmul"  # the checkpoint name of every `matmul`'s output


def float32_output_is_fast() -> bool:
    """Whether this backend's fast low-precision dot returns float32 (XLA:CPU: yes)."""
    return jax.default_backend() == "cpu"


def activation_dtype(compute_dtype: jnp.dtype | str) -> jnp.dtype:
    """The dtype activations (and every dot's output) are kept in: float32 for a float32 model; for a bfloat16
    model, float32 where that is the fast dot output (XLA:CPU), else bfloat16."""
    compute = jnp.dtype(compute_dtype)
    if compute == jnp.float32 or float32_output_is_fast():
        return jnp.dtype(jnp.float32)
    return compute


def inference_param_dtype(compute_dtype: jnp.dtype | str, param_dtype: jnp.dtype | str) -> jnp.dtype:
    """The dtype the sampler and the reference store weights in: bfloat16 when either `param_dtype` or the compute
    dtype is (every dot reads its operands in the compute dtype, so bf16 storage halves the bytes read and changes
    no result); float32 otherwise."""
    low = jnp.dtype(jnp.bfloat16)
    return low if low in (jnp.dtype(compute_dtype), jnp.dtype(param_dtype)) else jnp.dtype(jnp.float32)


def _gradient_specs(spec: str) -> tuple[str, str]:
    """Einsum specs of the two operands' gradients for `spec = "a,b->out"` (no repeated or operand-only indices):
    `d_a = einsum("out,b->a", g, b)`, `d_b = einsum("a,out->b", a, g)`."""
    inputs, out = spec.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def float32_dot(spec: str, a: Array, b: Array, compute_dtype: jnp.dtype) -> Array:
    """`einsum(spec, a, b)` of `compute_dtype` operands accumulated and returned in float32.

    On XLA:CPU a weight gradient `x^T g` ("ik,in->kn": two matrices contracted over their leading axis) is a dot
    of a column-major operand, which the fast (YNNPACK) dot does not take: XLA runs it as a float32 dot of upcast
    operands instead, 2-4x slower than the bf16 one (SmolLM2's `3060 x 576 x 1536` weight gradient: 300 against
    826 GFLOP/s here, `bench/matmul_kernels.py`). So the operand whose free axis leads the output is transposed
    into a row-major copy and the dot is a plain row-major GEMM with the output in its own order: the same sum.
    Both layouts are pinned (`with_layout_constraint`): XLA otherwise folds the transpose, or a caller's transpose
    of the result, back into the dot's dimensions, and such a bf16 dot can land on a path that does not run bf16
    at all ("Unsupported element type for DotThunk"). Chosen by the default backend: a CPU machine exporting a
    program for CUDA gives it these layout constraints too (a transposing copy there, the same values).
    """
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    a, b = a.astype(compute_dtype), b.astype(compute_dtype)
    if a.ndim == b.ndim == 2 and sa[0] == sb[0] and jax.default_backend() == "cpu":
        if out == sb[1] + sa[1]:
            sa, sb, a, b = sb, sa, b, a
        if out == sa[1] + sb[1]:  # the transposed operand is the one whose free axis leads the output
            row_major = Layout((0, 1))
            a_t = with_layout_constraint(a.T, row_major)
            y = jnp.einsum(f"{sa[::-1]},{sb}->{out}", a_t, b, preferred_element_type=jnp.float32)
            return with_layout_constraint(y, row_major)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _low_precision_einsum(spec: str, a: Array, b: Array, compute_dtype: jnp.dtype) -> Array:
    return float32_dot(spec, a, b, compute_dtype)


def _low_precision_einsum_fwd(spec: str, a: Array, b: Array, compute_dtype: jnp.dtype) -> tuple[Array, tuple]:
    # The residuals are the operands as given, cast again in the backward: a weight is then the layer stack's
    # own slice, which the layer scan does not copy into a stacked residual buffer, and an activation is usually
    # saved for its other consumers anyway (the SmolLM2 bf16 update: 11.5 s with bf16 copies, 9.8 s without).
    return _low_precision_einsum(spec, a, b, compute_dtype), (a, b)


def _low_precision_einsum_bwd(spec: str, compute_dtype: jnp.dtype, residuals: tuple, g: Array) -> tuple[Array, Array]:
    a, b = residuals
    spec_a, spec_b = _gradient_specs(spec)
    g_c = g.astype(compute_dtype)
    d_a = float32_dot(spec_a, g_c, b, compute_dtype)
    d_b = float32_dot(spec_b, a, g_c, compute_dtype)
    return d_a.astype(a.dtype), d_b.astype(b.dtype)


_low_precision_einsum.defvjp(_low_precision_einsum_fwd, _low_precision_einsum_bwd)


def einsum(spec: str, a: Array, b: Array, compute_dtype: jnp.dtype | str,
           out_dtype: jnp.dtype | str | None = None) -> Array:
    """`einsum(spec, a, b)` under the policy: operands in `compute_dtype`, float32 accumulation, the result in
    `out_dtype` (default `activation_dtype(compute_dtype)`; float32 for what a softmax reads: attention scores,
    logits); forward and backward dots alike.

    `spec` is a two-operand contraction `"a,b->out"` in which every index of an operand appears in the other
    operand or the output (what a matmul or attention's contractions are). Shapes follow `spec`.
    """
    compute = jnp.dtype(compute_dtype)
    if compute == jnp.float32:
        return jnp.einsum(spec, a.astype(compute), b.astype(compute), preferred_element_type=jnp.float32)
    out = _low_precision_einsum(spec, a, b, compute)
    return out.astype(activation_dtype(compute) if out_dtype is None else out_dtype)


def matmul(x: Array, w: Array, compute_dtype: jnp.dtype | str, out_dtype: jnp.dtype | str | None = None) -> Array:
    """`x [..., K] @ w [K, N] -> [..., N]` under the policy (see `einsum`; `out_dtype` as there).

    `x` is flattened to `[rows, K]` around the dot: XLA:CPU then computes the weight gradient as one plain GEMM
    instead of a batched contraction with transposes (the GRPO step 2.0-2.4 s -> 1.4 s on the bench model).
    """
    y = einsum("ik,kn->in", x.reshape(-1, x.shape[-1]), w, compute_dtype, out_dtype)
    # The name `model.remat_policy=matmuls` saves (`decoder.layer_checkpoint`): the dot itself sits inside a custom VJP
    # under a low-precision policy, where `jax.checkpoint`'s dot policies cannot see it.
    return checkpoint_name(y.reshape(*x.shape[:-1], w.shape[-1]), WEIGHT_MATMUL)


def matmul_transposed(x: Array, w: Array, compute_dtype: jnp.dtype | str,
                      out_dtype: jnp.dtype | str | None = None) -> Array:
    """`x [..., K] @ w[N, K]^T -> [..., N]` under the policy, without materialising the transpose (the tied
    unembedding: `hidden @ embedding^T`)."""
    flat = x.reshape(-1, x.shape[-1])
    y = einsum("ik,nk->in", flat, w, compute_dtype, out_dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _cpu_flags() -> str:
    """The CPU's feature flags as Linux reports them (`flags` on x86, `Features` on Arm), else ""."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1] for line in lines if line.startswith(("flags", "Features")) and ":" in line),
                "")


def cpu_bf16_feature(flags: str | None = None, machine: str | None = None) -> str | None:
    """The CPU feature that gives bfloat16 dots at bfloat16's speed (`amx_bf16`, `avx512_bf16` on x86; `bf16` on Arm),
    read from `flags` (default: Linux's `/proc/cpuinfo`, as the engine's kernels read it), or None."""
    machine = (machine or host_platform.machine()).lower()
    words = set((_cpu_flags() if flags is None else flags).split())
    candidates = ("amx_bf16", "avx512_bf16") if machine in ("x86_64", "amd64") else \
        ("bf16",) if machine in ("aarch64", "arm64") else ()
    return next((f for f in candidates if f in words), None)


def auto_compute_dtype(backend: str | None = None, flags: str | None = None, machine: str | None = None
                       ) -> tuple[str, str]:
    """`model.dtype: auto`: `(dtype, why)`. bfloat16 on an accelerator (`backend`, default JAX's) and on a CPU with
    native bfloat16 dots (`cpu_bf16_feature`); float32 on any other CPU, where XLA:CPU's bfloat16 dot is slower than
    its float32 one (an AVX2-only CPU: about 0.6x, bench/HISTORY.md) and buys nothing but rounding."""
    backend = backend or jax.default_backend()
    if backend != "cpu":
        return "bfloat16", f"model.dtype=auto: bfloat16 on {backend.upper()}"
    feature = cpu_bf16_feature(flags, machine)
    if feature is not None:
        return "bfloat16", f"model.dtype=auto: bfloat16, the CPU has {feature}"
    return "float32", ("model.dtype=auto: float32, the CPU has no bfloat16 dots (no amx_bf16, avx512_bf16 or Arm "
                       "bf16), where bfloat16 is slower")


def resolve_compute_dtype(requested: str) -> str:
    """`requested` (`model.dtype`) as the dtype it runs in: `auto` by `auto_compute_dtype`, others as written."""
    return auto_compute_dtype()[0] if requested == "auto" else requested


def describe_compute_dtype(requested: str, resolved: str) -> str:
    """`compute dtype <resolved> (<why>)` for a run header: why `auto` chose it (`auto_compute_dtype`), else the
    setting as written."""
    why = auto_compute_dtype()[1] if requested == "auto" else f"model.dtype={requested}"
    return f"compute dtype {resolved} ({why})"
