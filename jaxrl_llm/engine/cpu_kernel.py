"""The CPU decode-attention kernel: `decode_attention.cc`, built on first use and called through XLA's FFI.

    decode_attention(q, k_new, v_new, positions, k, v, allowed, config) -> (out [B, 1, H * hd], k, v)

each row's new key and value written into the decode loop's contiguous caches (in place), then the same result as
`models.decode.loop_layout_attention` over them (keys and values as stored: bfloat16 bits or float32; `q` float32),
with the precision policy's roundings (bfloat16 operands, float32 sums). XLA:CPU has no paged or decode attention
kernel of its own: it runs the contraction as many tiny batched dots far below its memory speed and the one-token
write as a slow scatter; the kernel writes in place and streams each row's cache once (bench/README.md,
`decode_phases.py`).

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
TARGET = "jaxrl_llm_decode_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-mprefer-vector-width=512")


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
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {tail}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


@functools.cache
def _load() -> str | None:
    """Builds and registers the kernel once per process: None when it is ready, else why it is not."""
    if jax.default_backend() != "cpu" and "cpu" not in {d.platform for d in jax.devices("cpu")}:
        return "no CPU backend"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.DecodeAttention), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return str(error)
    return None


def available() -> bool:
    """Whether the CPU kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the CPU kernel cannot run here, or None when it can."""
    return _load()


def decode_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, positions: jax.Array, k: jax.Array,
                     v: jax.Array, allowed: jax.Array, config: ModelConfig
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's new key and value written into its cache, then `softmax(softcap(scale * q . K), allowed) . V` of
    its one query, as `models.decode.loop_layout_attention` (with `engine.model.slot_attention`'s write):

    `q [B, 1, H, hd]` or `[B, H, hd]` (float32), the new `k_new, v_new [B, KVH, hd]` written at `positions [B]`
    (negative: no write) into keys `[B, KVH, hd, C]` and values `[B, KVH, C, hd]` (as stored: bfloat16 bits as
    `uint16`, or float32; updated in place where XLA can donate them), `allowed [B, 1, C]` or `[B, C]`
    -> (`[B, 1, H * hd]` float32, keys, values)."""
    why = _load()
    if why is not None:
        raise RuntimeError(f"the CPU decode-attention kernel is unavailable: {why}")
    b, h, hd = q.shape[0], config.num_heads, config.head_dim
    shapes = (jax.ShapeDtypeStruct((b, h, hd), jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype))
    call = jax.ffi.ffi_call(TARGET, shapes, input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
    out, k, v = call(q.reshape(b, h, hd).astype(jnp.float32), k_new.astype(k.dtype), v_new.astype(v.dtype),
                     positions.astype(jnp.int32), k, v, allowed.reshape(b, -1).astype(bool),
                     scale=np.float32(config.attention_scale), softcap=np.float32(config.attn_logit_softcap or 0.0))
    return out.reshape(b, 1, h * hd), k, v
