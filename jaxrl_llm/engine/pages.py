"""A paged KV cache as pure functions: a pool of fixed-size pages per layer, read and written through page tables.

    pool (one per layer)   k, v  [KVH, num_pages, page_size, hd]       in the model's compute dtype
    page table (per row)   [max_pages] int32: the pages holding positions 0 .. max_pages * page_size - 1,
                           position p lives in page table[p // page_size] at offset p % page_size

A sequence's keys and values are as long as the sequence, not as the longest row of a batch: memory is
`pages in use * page_size * KVH * hd * 2 * L * itemsize`. Rows may share pages (the G samples of a GRPO group read
their prompt's pages; `allocator.py` counts the references), and a page is written only by the one row that owns
it. Positions are contiguous from 0 in every sequence (no left padding), so a key's slot in the gathered context
is its position. Allocation is on the host (`allocator.py`); everything here is jittable. The pool's layout is the one
JAX's Pallas paged-attention kernels read (`kernels.py`), so a GPU or TPU decode step attends over the pool as it is.

A bfloat16 pool is stored as its bits (`uint16`, `storage_dtype`): XLA:CPU runs a scatter into a bfloat16 buffer
by converting the whole buffer to float32 and back (a one-page copy cost 300 ms on SmolLM2's pool, a one-token
write per slot 8 ms per layer), and an integer scatter in place (0.2 ms and 0.05 ms); the bits are reinterpreted,
never converted, on the way in and out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig

PagedLayer = dict[str, jax.Array]  # {"k", "v": [KVH, num_pages, page_size, hd]}, in `storage_dtype`


def default_page_size(platform: str | None = None) -> int:
    """Tokens per page when a run sets none (`sampling.engine_page_size: 0`): 64 on the CPU, where the decode
    kernel reads a slot's pages from memory (the RL-shaped rollout 22.8 s with pages of 16, 20.7 s with 64; since
    the kernel prefetches across pages, 14.3 / 14.6 / 15.7 s with 32 / 64 / 128: docs/engine.md); 16 on GPU and
    TPU, as vLLM's default block, where a page's padding costs device memory."""
    return 64 if (platform or jax.default_backend()) == "cpu" else 16


def storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """How values of `dtype` are stored in the pool: 2-byte floats as `uint16` bits, others as they are."""
    return jnp.dtype(jnp.uint16) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype)


def to_storage(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`x` cast to the compute `dtype`, then as the pool stores it (bits for 2-byte floats)."""
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def from_storage(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Stored values back as `dtype` (the bits reinterpreted)."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def table_width(pages: int, page_size: int) -> int:
    """The page-table width of a decode call whose longest row holds `pages` pages: the next power of two up to
    128 tokens' worth, then a multiple of 128 tokens, so attention reads about the context the rows have (a short
    task's 30 tokens are not attended as 128) while few program shapes compile."""
    granule = max(1, 128 // page_size)
    if pages <= granule:
        return 1 << max(0, pages - 1).bit_length()
    return -(-pages // granule) * granule


def init_pages(config: ModelConfig, num_pages: int, page_size: int) -> list[PagedLayer]:
    """Zero pools, one per layer. Bytes: `2 * L * num_pages * page_size * KVH * hd * itemsize(dtype)`."""
    shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
    stored = storage_dtype(config.jnp_dtype)
    return [{"k": jnp.zeros(shape, stored), "v": jnp.zeros(shape, stored)} for _ in range(config.num_layers)]


def pool_geometry(pages: list[PagedLayer]) -> tuple[int, int]:
    """`(num_pages, page_size)` of a pool."""
    _, num_pages, page_size, _ = pages[0]["k"].shape
    return num_pages, page_size


def page_slots(page_table: jax.Array, positions: jax.Array, page_size: int, num_pages: int) -> jax.Array:
    """Flat pool slots `page * page_size + offset` of `positions [R, T]` (page tables `[R, M]`); a negative
    position (padding) maps to `num_pages * page_size`, one past the pool, which a write drops."""
    page = jnp.take_along_axis(page_table, jnp.maximum(positions, 0) // page_size, axis=1)
    return jnp.where(positions >= 0, page * page_size + positions % page_size, num_pages * page_size)


def write_pages(layer: PagedLayer, slots: jax.Array, k: jax.Array, v: jax.Array, dtype: jnp.dtype) -> PagedLayer:
    """`k, v [R, T, KVH, hd]` written (as compute `dtype`) at flat `slots [R, T]` (out-of-pool slots dropped)."""
    kvh, n, size, hd = layer["k"].shape

    def write(pool: jax.Array, new: jax.Array) -> jax.Array:
        flat = pool.reshape(kvh, n * size, hd)
        rows = jnp.swapaxes(new.reshape(-1, kvh, hd), 0, 1)  # [KVH, R * T, hd]
        flat = flat.at[:, slots.reshape(-1)].set(to_storage(rows, dtype), mode="drop")
        return flat.reshape(kvh, n, size, hd)

    return {"k": write(layer["k"], k), "v": write(layer["v"], v)}


def gather_pages(layer: PagedLayer, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's context `k, v [KVH, R, M * page_size, hd]` (as stored) from its page table `[R, M]` (slot s =
    position s).

    Whole pages are taken as rows of the pool viewed `[KVH, num_pages, page_size * hd]`: XLA:CPU copies such
    rows about 2x faster than it gathers `pool[:, page_table]` element by element (bench/README.md, the engine's
    section)."""
    r, m = page_table.shape
    kvh, n, size, hd = layer["k"].shape

    def gather(pool: jax.Array) -> jax.Array:
        return jnp.take(pool.reshape(kvh, n, -1), page_table.reshape(-1), axis=1).reshape(kvh, r, m * size, hd)

    return gather(layer["k"]), gather(layer["v"])


def copy_pages(pages: list[PagedLayer], source: jax.Array, target: jax.Array) -> list[PagedLayer]:
    """Every layer's pages `source [n]` copied onto pages `target [n]` (copy on write of a shared partial page)."""
    return [{name: pool.at[:, target].set(pool[:, source]) for name, pool in layer.items()} for layer in pages]


def context_allowed(positions: jax.Array, context: int, sliding_window: int | None) -> jax.Array:
    """Boolean `[R, T, context]`: the query at position `positions[r, t]` may read the key at position `s`
    (`s <= position`, within the sliding window if any); padded queries (position < 0) read nothing."""
    s = jnp.arange(context)[None, None, :]
    p = positions[:, :, None]
    allowed = (s <= p) & (p >= 0)
    if sliding_window is not None:
        allowed &= p - s < sliding_window
    return allowed
