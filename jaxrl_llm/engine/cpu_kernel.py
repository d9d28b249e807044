"""The CPU paged decode-attention kernel: `decode_attention.cc`, built on first use and called through XLA's FFI.

    paged_decode_attention(q [S, H, hd], k_pages, v_pages [KVH, N, page_size, hd], page_table [S, M],
                           lengths [S], window, config) -> [S, H, hd]

one query per slot over its first `lengths` positions (the last `window` of them under a sliding window) straight
through its page table, the pool as stored (bfloat16 bits or float32), with the precision policy's roundings
(bfloat16 operands, float32 sums): what the engine's XLA path computes over gathered contiguous caches
(`model.slot_caches`, `models.decode.loop_layout_attention`). XLA:CPU has no paged or decode attention of its own;
its path copies every slot's context once per decode call and runs the contraction as many tiny batched dots far
below its memory speed (bench/README.md, `decode_phases.py`). The kernel reads the pages where they are, so the G
samples of a group read their prompt's shared pages (from cache) and a decode call holds no contiguous caches.

Building: the source is compiled once per machine with the system's C++ compiler (`$CXX`, else `c++`/`g++`) against
jaxlib's FFI headers, `-O3 -march=native`, into `$JAXRL_LLM_KERNEL_CACHE` (default `~/.cache/jaxrl_llm/kernels`),
named by a hash of the source, the flags, jaxlib's version and the CPU, then registered as an FFI target.
`available()` says whether that worked; where it did not (no compiler) the engine decodes on the XLA path and
`unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxrl_llm.models.config import ModelConfig

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "jaxrl_llm_paged_decode_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         # x86: let the 16-lane vectors be one AVX-512 register where the CPU has them (GCC prefers 256 bits)
         *(("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()))


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


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


def _build(compiler: str) -> Path:
    """The compiled library, from the cache when this source, these flags, this jaxlib and this CPU built it
    before. Written to a temporary name and renamed, so concurrent processes never load a half-written file."""
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), compiler, jaxlib.__version__,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"decode_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines() or ["no output"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {first_error.strip()}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel once per process: None when it is ready, else why it is not."""
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.PagedDecodeAttention), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return str(error)
    return None


def available() -> bool:
    """Whether the CPU kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the CPU kernel cannot run here, or None when it can."""
    return _load()


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, window: int | None, config: ModelConfig) -> jax.Array:
    """`q [S, H, hd]` (float32, unscaled) over the pool's `k_pages, v_pages [KVH, N, page_size, hd]` (as stored)
    at `page_table [S, M]`: each row reads its positions `max(0, length - window) .. length - 1` (`lengths [S]`;
    0 reads nothing and gives zeros) -> `[S, H, hd]` float32."""
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU decode-attention kernel is unavailable: {why}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
                window=np.int64(window or 0), scale=np.float32(config.attention_scale),
                softcap=np.float32(config.attn_logit_softcap or 0.0))
