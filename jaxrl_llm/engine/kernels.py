"""The decode step's attention per backend, straight over the page pool: JAX's Pallas paged-attention kernels (GPU:
Triton, TPU: Mosaic) and, on the CPU, this project's C++ kernel.

One new query per slot attends to the first `length` positions of its sequence through its page table:

    out[r, h] = softmax(scale * q[r, h] . K[r, :length[r]]^T) . V[r, :length[r]]      (soft-capped where the model is)

with `K, V` read from `pages [KVH, num_pages, page_size, hd]` (`pages.py`'s layout is these kernels' layout) at
`page_table [R, M]`. The kernels take no scale: `q` is scaled first. A slot with `length 0` reads nothing.

Where each runs (`attention_backend`):
- `pallas_gpu`: `jax.experimental.pallas.ops.gpu.paged_attention`, any head size;
- `pallas_tpu`: `jax.experimental.pallas.ops.tpu.paged_attention`, head sizes that are multiples of 128 (Mosaic's
  tiling); other heads use the XLA path;
- `pallas_interpret`: the GPU kernel in Pallas' interpreter, on any device (slow; what the tests check the kernel's
  use against);
- `cpu`: XLA:CPU has no paged-attention kernel; this project's C++ one (`cpu_kernel.py`, built on first use, sliding
  windows included) attends over the pool as stored;
- `xla`: no kernel: the decode call gathers each slot's context once into contiguous caches (`model.slot_caches`)
  and attends with XLA's dots (an engine on several devices; a CPU without a C++ compiler; checking the kernels).

Neither Pallas kernel has a sliding window: a model with sliding-window layers decodes on the XLA path on GPU and
TPU. No kernel has attention sinks: gpt-oss decodes on the XLA path everywhere (`auto` picks it; asking for a kernel
is an error naming why).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.pages import from_storage
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig


def sinks_unsupported(config: ModelConfig) -> str | None:
    """Why no paged-attention kernel (Pallas or C++) can decode `config`: attention sinks (gpt-oss), or None."""
    if config.attention_sinks:
        return "the model has attention sinks (gpt-oss), which the paged-attention kernels do not add"
    return None


def kernel_unsupported(config: ModelConfig, platform: str) -> str | None:
    """Why the Pallas kernel of `platform` ("gpu", "tpu" or "cpu" for the interpreter) cannot decode `config`, or
    None when it can."""
    if sinks_unsupported(config):
        return sinks_unsupported(config)
    if any(config.is_sliding(i) for i in range(config.num_layers)):
        return "the model has sliding-window layers, which the Pallas paged-attention kernels do not mask"
    if platform == "tpu" and config.head_dim % 128:
        return f"the TPU kernel needs a head size that is a multiple of 128 (this model's is {config.head_dim})"
    return None


def attention_backend(config: ModelConfig, requested: str, platform: str | None = None) -> str:
    """The decode attention a run uses: `requested` is `auto` (the platform's kernel where it can run the model:
    Pallas on GPU and TPU, the C++ kernel on the CPU where it builds; else `xla`), `xla`, `cpu` (the C++ kernel; an
    error where it cannot be built), or `pallas` (the platform's kernel; on the CPU the GPU kernel in the
    interpreter; an error when the kernel cannot run the model)."""
    platform = platform or jax.default_backend()
    kernel = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
    if requested == "cpu" or (requested == "auto" and platform == "cpu"):
        why = cpu_kernel.unavailable_reason() or sinks_unsupported(config)
        if why is None:
            return "cpu"
        if requested == "cpu":
            raise ConfigError(f"sampling.engine_attention=cpu: {why}; use auto or xla")
        return "xla"
    if requested == "xla" or (requested == "auto" and (kernel is None or kernel_unsupported(config, platform))):
        return "xla"
    if requested == "auto":
        return kernel  # type: ignore[return-value]
    if requested != "pallas":
        raise ConfigError(f"sampling.engine_attention must be auto, xla, cpu or pallas, not {requested!r}")
    why = kernel_unsupported(config, "tpu" if kernel == "pallas_tpu" else "gpu")
    if why:
        raise ConfigError(f"sampling.engine_attention=pallas: {why}; use auto or xla")
    return kernel or "pallas_interpret"


def describe_paths(config: ModelConfig, requested: str = "auto", devices: int = 1, platform: str | None = None
                   ) -> str:
    """What the rollout engine's decode step runs for `config` on `devices` devices an engine (a data-parallel shard's),
    in words, and where a kernel is not used, why (no compiler, the compiler's first error, no AMX, a float32 model,
    sinks, several devices): the attention,
    the matmuls and the sampling draw. The same choices as `Engine` makes (`attention_backend`)."""
    platform = platform or jax.default_backend()
    if devices > 1:
        attention, why = "xla", f"{devices} devices an engine (the kernels run on one device)"
    else:
        attention = attention_backend(config, requested, platform)
        why = None
        if attention == "xla":
            why = ("sampling.engine_attention=xla" if requested == "xla" else
                   cpu_kernel.unavailable_reason() or sinks_unsupported(config) if platform == "cpu" else
                   kernel_unsupported(config, platform) or f"no paged-attention kernel on {platform}")
    names = {"cpu": "the C++ kernel" + (" (AVX-512 bf16)" if cpu_kernel.has_avx512_bf16() else ""),
             "pallas_gpu": "Pallas (GPU)", "pallas_tpu": "Pallas (TPU)", "pallas_interpret": "Pallas (interpreted)",
             "xla": "XLA"}
    text = f"attention {names[attention]}" + (f" (no kernel: {why})" if why else "")
    if attention != "cpu":
        return f"{text}; matmuls and sampling XLA"
    if config.jnp_dtype != jnp.bfloat16:
        matmul = "XLA (the AMX kernel packs bfloat16 models; this one computes in float32)"
    else:
        no_amx = cpu_kernel.packed_matmul_unavailable_reason()
        matmul = f"XLA (no AMX kernel: {no_amx})" if no_amx else "the AMX kernel"
    no_draw = cpu_kernel.sampling_unavailable_reason()
    draw = f"XLA ({no_draw})" if no_draw else "the C++ kernel"
    return f"{text}; matmuls {matmul}; sampling {draw}"


def _gpu_blocking(pages_per_sequence: int) -> tuple[int, int]:
    """`(k_splits, pages_per_compute_block)` the GPU kernel accepts for page tables `pages_per_sequence` wide: the
    table splits evenly into `k_splits` partitions (up to 16, the kernel's default, for parallelism over the context)
    and each partition into compute blocks of up to 8 pages."""
    k_splits = math.gcd(pages_per_sequence, 16)
    return k_splits, math.gcd(pages_per_sequence // k_splits, 8)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, config: ModelConfig, backend: str, window: int | None = None
                           ) -> jax.Array:
    """`q [R, H, hd]` (unscaled) over the pool's `k_pages, v_pages [KVH, N, page_size, hd]` as stored
    (`pages.storage_dtype`) at `page_table [R, M]`, the first `lengths [R]` positions of each row (the last `window`
    of them on a sliding-window layer: the C++ kernel only) -> `[R, H, hd]` in `q`'s dtype. The Pallas kernels take
    `q` in the pages' compute dtype (their dots need one operand type); the C++ kernel reads bfloat16 bits itself."""
    if backend == "cpu":
        return cpu_kernel.paged_decode_attention(q, k_pages, v_pages, page_table, lengths, window,
                                                 config).astype(q.dtype)
    k_pages, v_pages = (from_storage(x, config.jnp_dtype) for x in (k_pages, v_pages))
    scaled = (q.astype(jnp.float32) * config.attention_scale).astype(k_pages.dtype)
    cap = config.attn_logit_softcap
    lengths = lengths.astype(jnp.int32)
    if backend == "pallas_tpu":
        out = tpu_paged_attention(scaled, k_pages, v_pages, lengths, page_table, attn_logits_soft_cap=cap,
                                  pages_per_compute_block=math.gcd(page_table.shape[1], 8))
        return out.astype(q.dtype)
    if backend in ("pallas_gpu", "pallas_interpret"):
        k_splits, block = _gpu_blocking(page_table.shape[1])
        out = gpu_paged_attention(scaled, k_pages, v_pages, page_table, lengths, k_splits=k_splits,
                                  pages_per_compute_block=block, attn_logits_soft_cap=cap,
                                  interpret=backend == "pallas_interpret")
        return out.astype(q.dtype)
    raise ValueError(f"no paged-attention kernel for backend {backend!r}")
