"""The engine's CPU kernels: C++ sources built on first use and called through XLA's FFI.

    paged_decode_attention(q [S, H, hd], k_pages, v_pages [KVH, N, page_size, hd], page_table [S, M],
                           lengths [S], window, config) -> [S, H, hd]          (decode_attention.cc)
    packed_matmul(x [..., K], pack_weight(w [K, N]), norm=) -> [..., N] float32   (packed_matmul.cc, AMX)
    packed_gated_matmul(x [..., K], pack_gated_weight(gate|up [K, 2I]), act, norm=) -> [..., I] bfloat16   (the same)
    inverse_cdf_sample(logits [B, V], uniform [B], temperature) -> token, logprob [B]   (inverse_cdf.cc)

The attention: one query per slot over its first `lengths` positions (the last `window` of them under a sliding
window) straight through its page table, the pool as stored (bfloat16 bits or float32), with the precision policy's
roundings (bfloat16 operands, float32 sums): what the engine's XLA path computes over gathered contiguous caches
(`model.slot_caches`, `models.decode.loop_layout_attention`). XLA:CPU has no paged or decode attention of its own;
its path copies every slot's context once per decode call and runs the contraction as many tiny batched dots far
below its memory speed (bench/README.md, `decode_phases.py`). The kernel reads the pages where they are, so the G
samples of a group read their prompt's shared pages (from cache) and a decode call holds no contiguous caches.

The matmul: a decode step's few rows times a bfloat16 weight packed once per generate call into AMX's tile layout
(`pack_weight`), float32 out, equal to XLA's `x @ w` with a float32 result. XLA:CPU re-packs a weight on every call,
which at a decode step's 32 rows is half of the matmuls' time (bench/README.md). Only on x86 CPUs with AMX
(`amx_bf16`, Sapphire Rapids and later), for bfloat16 models; elsewhere the engine keeps XLA's matmuls. With a
`Norm`, float32 rows are RMS-normalized in the kernel as they are rounded (the block's pre-norm and the cast, three
small XLA ops a norm).

The gated matmul: the same kernel on a gated MLP's gate|up, returning `act(x @ gate) * (x @ up)` rounded to bfloat16
(the down projection's operand) instead of the `[M, 2I]` float32 product that XLA would read back for the activation
and the cast.

The sampling: each row's token drawn from `softmax(logits / T)` by the inverse CDF of its own uniform, the draw of
`sampling.logits.inverse_cdf_sample` in one pass over the logits from memory, where XLA:CPU makes four (the
engine's untruncated draws on the CPU kernel's path).

Building: each source is compiled once per machine with the system's C++ compiler (`$CXX`, else
`c++`/`g++`) against jaxlib's FFI headers, `-O3 -march=native`, into `$JAXRL_LLM_KERNEL_CACHE` (default
`~/.cache/jaxrl_llm/kernels`), named by a hash of the source, the flags, jaxlib's version and the CPU, then
registered as an FFI target. `unavailable_reason()` / `packed_matmul_unavailable_reason()` /
`sampling_unavailable_reason()` say why a kernel cannot run here (no compiler, no AMX), or None; where the attention
cannot, the engine decodes on the XLA path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # not POSIX: concurrent first builds each compile (the rename keeps the file whole)
    fcntl = None

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import rms_norm
from jaxrl_llm.sampling.logits import inverse_cdf_block

HERE = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         # x86: let the 16-lane vectors be one AVX-512 register where the CPU has them (GCC prefers 256 bits)
         *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()))


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """A C++ source, the extra compiler flags it needs, and its FFI handler symbol and target name."""

    source: Path
    symbol: str
    target: str
    flags: tuple[str, ...] = ()


ATTENTION = _Kernel(HERE / "decode_attention.cc", "PagedDecodeAttention", "jaxrl_llm_paged_decode_attention")
SAMPLING = _Kernel(HERE / "inverse_cdf.cc", "InverseCdfSample", "jaxrl_llm_inverse_cdf_sample")
# The attention built without AVX512-BF16 (the code CPUs without it run), so the tests check both on one that has it.
PORTABLE_ATTENTION = dataclasses.replace(ATTENTION, target="jaxrl_llm_paged_decode_attention_portable",
                                         flags=("-mno-avx512bf16",))
MATMUL = _Kernel(HERE / "packed_matmul.cc", "PackedMatmul", "jaxrl_llm_packed_matmul", ("-mamx-tile", "-mamx-bf16"))


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def compiler_name() -> str | None:
    """The C++ compiler the kernels are built with (`$CXX`, else c++, g++ or clang++ on the PATH), or None."""
    return _compiler()


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU's model and flags (Linux), else the machine name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.machine()


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXRL_LLM_KERNEL_CACHE", Path.home() / ".cache" / "jaxrl_llm" / "kernels"))


def _build(compiler: str, kernel: _Kernel = ATTENTION) -> Path:
    """The compiled library, from the cache when this source, these flags, this jaxlib and this CPU built it
    before. Written to a temporary name and renamed, so concurrent processes never load a half-written file, under
    a lock beside it, so they compile it once."""
    flags = (*FLAGS, *kernel.flags)
    headers = [h.read_text() for h in sorted(kernel.source.parent.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\n".join([kernel.source.read_text(), *headers, " ".join(flags), compiler,
                                    jaxlib.__version__, _cpu_signature()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{kernel.source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One process compiles, the others starting at once (pytest's workers, a sampler beside a trainer) wait for it.
    with open(out.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            command = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(kernel.source), "-o", str(partial)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                lines = result.stderr.strip().splitlines() or ["no output"]
                first_error = next((line for line in lines if "error" in line), lines[-1])
                raise RuntimeError(f"{compiler} could not build {kernel.source.name}: {first_error.strip()}")
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
    return out


def has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX512-BF16 (Linux's `avx512_bf16` flag): the attention's bfloat16 code then uses it."""
    return platform.machine().lower() in ("x86_64", "amd64") and "avx512_bf16" in _cpu_signature().split()


def _has_amx() -> bool:
    """Whether the CPU reports AMX's bfloat16 tiles (Linux's `amx_bf16` flag)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return "amx_bf16" in _cpu_signature().split()


@functools.cache
def _load(kernel: _Kernel = ATTENTION) -> str | None:
    """Builds and registers `kernel` once per process: None when it is ready, else why it is not."""
    if kernel == MATMUL and not _has_amx():
        return "this CPU has no AMX (amx_bf16)"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler, kernel)))
        if kernel == MATMUL and not library.JaxrlAmxPermitted():
            return "Linux did not grant this process AMX's tiles (arch_prctl ARCH_REQ_XCOMP_PERM)"
        jax.ffi.register_ffi_target(kernel.target, jax.ffi.pycapsule(getattr(library, kernel.symbol)),
                                    platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return str(error)
    return None


def available() -> bool:
    """Whether the CPU attention kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the CPU attention kernel cannot run here, or None when it can."""
    return _load()


def packed_matmul_unavailable_reason() -> str | None:
    """Why the AMX matmul cannot run here (no AMX, no compiler), or None when it can."""
    return _load(MATMUL)


def sampling_unavailable_reason() -> str | None:
    """Why the sampling kernel cannot run here (no compiler), or None when it can."""
    return _load(SAMPLING)


def inverse_cdf_sample(logits: jax.Array, uniform: jax.Array, temperature: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """Each row's token drawn from `softmax(logits / temperature)` (`logits [B, V]`) by the inverse CDF of its
    `uniform [B]`, and its log-probability: `(token [B] int32, logprob [B] float32)`. The draw of
    `sampling.logits.inverse_cdf_sample` over `exp(s - max s)` (blocks of `inverse_cdf_block(V)`), in one pass
    over the logits from memory (`inverse_cdf.cc`)."""
    why = _load(SAMPLING)
    if why is not None:
        raise RuntimeError(f"the CPU sampling kernel is unavailable: {why}")
    rows, vocab = logits.shape
    call = jax.ffi.ffi_call(SAMPLING.target, (jax.ShapeDtypeStruct((rows,), jnp.int32),
                                              jax.ShapeDtypeStruct((rows,), jnp.float32)), vmap_method="sequential")
    return call(logits.astype(jnp.float32), uniform.astype(jnp.float32), jnp.asarray(temperature, jnp.float32),
                block=np.int64(inverse_cdf_block(vocab)))


def packable(w: jax.Array) -> bool:
    """Whether `w [K, N]` packs with no padded columns (N a multiple of 16): `packed_matmul`'s output is then
    exactly `[..., N]` and the matrix can stand in for `w` anywhere."""
    return w.ndim == 2 and w.shape[1] % 16 == 0


def pack_weight(w: jax.Array) -> jax.Array:
    """`w [K, N]` as bfloat16 in AMX's tile layout `[ceil(N / 16), ceil(K / 32), 16, 32]`: tile `(nb, kb)` holds
    `w[32 kb + 2 p + e, 16 nb + n]` at row `p`, column `2 n + e` (K and N padded with zeros): the layout
    `packed_matmul.cc` streams. A pure permutation, made once per generate call."""
    k, n = w.shape
    kp, np_ = -(-k // 32) * 32, -(-n // 16) * 16
    w = jnp.pad(w.astype(jnp.bfloat16), ((0, kp - k), (0, np_ - n)))
    return w.reshape(kp // 32, 16, 2, np_ // 16, 16).transpose(3, 0, 1, 4, 2).reshape(np_ // 16, kp // 32, 16, 32)


class Norm(NamedTuple):
    """A block's RMS norm for the matmul to apply to its input first (`models.layers.rms_norm`): `scale [K]` (or
    `[1, K]`), `eps`, Gemma's `unit_offset`."""

    scale: jax.Array
    eps: float
    unit_offset: bool = False


def _kernel_input(x: jax.Array, norm: Norm | None) -> tuple[jax.Array, jax.Array, dict]:
    """`x [..., K]` as the kernel's rows `[M, K]`, the norm's scale (`[0]`: none) and attributes. A float32 `x` goes
    in as it is (the kernel rounds it, normalizing first with `norm`); any other is rounded here, and a norm over it
    is XLA's (`rms_norm` of another dtype rounds twice, which the kernel does not)."""
    flat, none = x.reshape(-1, x.shape[-1]), {"eps": np.float32(0), "unit_offset": np.int64(0)}
    if flat.dtype != jnp.float32:
        if norm is not None:
            flat = rms_norm(flat, norm.scale.reshape(-1), norm.eps, unit_offset=norm.unit_offset)
        return flat.astype(jnp.bfloat16), jnp.zeros((0,), jnp.float32), none
    if norm is None:
        return flat, jnp.zeros((0,), jnp.float32), none
    scale = norm.scale.reshape(-1).astype(jnp.float32)
    return flat, scale, {"eps": np.float32(norm.eps), "unit_offset": np.int64(norm.unit_offset)}


def _matmul_call(x: jax.Array, packed: jax.Array, norm: Norm | None, width: int, dtype: jnp.dtype,
                 activation: int) -> jax.Array:
    """`packed_matmul.cc` on `x [..., K]`'s rows: `[M, width]` of `dtype`."""
    why = _load(MATMUL)
    if why is not None:
        raise RuntimeError(f"the AMX matmul kernel is unavailable: {why}")
    flat, scale, attributes = _kernel_input(x, norm)
    call = jax.ffi.ffi_call(MATMUL.target, jax.ShapeDtypeStruct((flat.shape[0], width), dtype),
                            vmap_method="sequential")
    return call(flat, packed, scale, activation=np.int64(activation), **attributes)


def packed_matmul(x: jax.Array, packed: jax.Array, n: int | None = None, norm: Norm | None = None) -> jax.Array:
    """`x [..., K] @ w -> [..., N]` float32 for `packed = pack_weight(w)`: `x` rounded to bfloat16 (the precision
    policy's operand), products summed in float32 by AMX. `n`: w's columns where `pack_weight` padded them.
    `norm`: `rms_norm(x, ...)` first (in the kernel for a float32 `x`), then the rounding."""
    padded = packed.shape[0] * 16
    out = _matmul_call(x, packed, norm, padded, jnp.float32, 0)
    return (out if n is None or n == padded else out[:, :n]).reshape(*x.shape[:-1], n or padded)


# `packed_matmul.cc`'s codes of `models.layers.gated_activation`'s activations
GATED_ACTIVATIONS = {"silu": 1, "gelu_pytorch_tanh": 2}


def pack_gated_weight(gate_up: jax.Array) -> jax.Array:
    """A gated MLP's `gate|up [K, 2I]` (gate's columns first) packed with their 16-column blocks interleaved (gate
    block j, then up block j; I a multiple of 16): `pack_weight` of the reordered matrix, what
    `packed_gated_matmul` reads."""
    k, n = gate_up.shape
    interleaved = gate_up.reshape(k, 2, n // 32, 16).transpose(0, 2, 1, 3).reshape(k, n)
    return pack_weight(interleaved)


def packed_gated_matmul(x: jax.Array, packed: jax.Array, hidden_act: str, norm: Norm | None = None) -> jax.Array:
    """`act(x @ gate) * (x @ up)` `[..., I]` bfloat16 for `packed = pack_gated_weight(gate|up)`: the products as in
    `packed_matmul` (float32 sums), the activation (`silu`, `gelu_pytorch_tanh`) and the product in float32, rounded
    to bfloat16 once: `models.layers.gated_activation` on `packed_matmul`'s output, then the down projection's cast.
    `norm`: as `packed_matmul`'s."""
    width = packed.shape[0] * 8
    out = _matmul_call(x, packed, norm, width, jnp.bfloat16, GATED_ACTIVATIONS[hidden_act])
    return out.reshape(*x.shape[:-1], width)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, window: int | None, config: ModelConfig,
                           kernel: _Kernel = ATTENTION) -> jax.Array:
    """`q [S, H, hd]` (float32, unscaled) over the pool's `k_pages, v_pages [KVH, N, page_size, hd]` (as stored)
    at `page_table [S, M]`: each row reads its positions `max(0, length - window) .. length - 1` (`lengths [S]`;
    0 reads nothing and gives zeros) -> `[S, H, hd]` float32. `kernel`: another build of the source (the tests'
    `PORTABLE_ATTENTION`)."""
    why = _load(kernel)
    if why is not None:
        raise RuntimeError(f"the CPU decode-attention kernel is unavailable: {why}")
    call = jax.ffi.ffi_call(kernel.target, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
                window=np.int64(window or 0), scale=np.float32(config.attention_scale),
                softcap=np.float32(config.attn_logit_softcap or 0.0))
