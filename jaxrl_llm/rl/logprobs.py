"""Per-token log-probabilities and entropy of the taken tokens, from logits or from final hidden states.

Every function is pure, jittable and vmappable. Static configuration (temperature may be traced, but
``chunk_size``, ``with_entropy`` ... are Python values) is passed by keyword so a caller marks it static with
``functools.partial`` or ``static_argnames``. Shapes: ``logits [B, T, V]``, ``tokens [B, T]``. All softmax /
log-softmax work runs in float32, whatever the input dtype. Masked reductions and loss aggregation:
``jaxrl_llm.rl.reductions``.
"""

from collections.abc import Callable
from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax import Array, lax

from jaxrl_llm.models.layers import softcap
from jaxrl_llm.models.precision import matmul, matmul_transposed


def _entropy_from_scaled(z: Array, lse: Array) -> Array:
    # -sum p * (z - lse) rather than lse - sum p * z: the latter cancels two large numbers in float32.
    # The where keeps a -inf logit (p = 0) from giving 0 * -inf = nan.
    log_probs = z - lse[..., None]
    probs = jnp.exp(log_probs)
    return -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)


def _logprobs_entropy_f32(
    logits: Array, tokens: Array, temperature: float | Array, with_entropy: bool
) -> tuple[Array, Array | None]:
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    # mode="clip": an out-of-range pad id (e.g. -100) must give a finite value, not a NaN fill.
    picked = jnp.take_along_axis(z, tokens[..., None].astype(jnp.int32), axis=-1, mode="clip")[..., 0]
    logp = picked - lse
    if not with_entropy:
        return logp, None
    return logp, _entropy_from_scaled(z, lse)


def token_logprobs(logits: Array, tokens: Array, *, temperature: float | Array = 1.0) -> Array:
    """Log-probability of the taken tokens, ``log softmax(logits / temperature)[tokens]``, in float32.

    Computed as ``z[token] - logsumexp(z)`` with ``z = logits / temperature`` so no full log-softmax is
    formed. Use the same temperature the sampler used, or the importance ratio is biased.

    Shapes: ``logits [B, T, V]`` (any float dtype), ``tokens [B, T]`` int -> ``[B, T]`` float32.
    Tokens outside ``[0, V)`` (padding ids) are clipped into range; mask those positions downstream.
    """
    return _logprobs_entropy_f32(logits, tokens, temperature, with_entropy=False)[0]


def token_entropy(logits: Array, *, temperature: float | Array = 1.0) -> Array:
    """Per-token entropy ``H = -sum_v p_v log p_v`` of ``p = softmax(logits / temperature)``, float32.

    Shapes: ``logits [B, T, V]`` -> ``[B, T]``.
    """
    z = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    return _entropy_from_scaled(z, jax.nn.logsumexp(z, axis=-1))


def token_logprobs_and_entropy(
    logits: Array, tokens: Array, *, temperature: float | Array = 1.0
) -> tuple[Array, Array]:
    """``(token_logprobs, token_entropy)`` sharing one float32 logsumexp. Shapes as in those functions."""
    logp, entropy = _logprobs_entropy_f32(logits, tokens, temperature, with_entropy=True)
    assert entropy is not None
    return logp, entropy


def _map_over_time_chunks(
    block_fn: Callable[[Array | int, int], tuple[Array, ...]],
    num_steps: int,
    chunk_size: int,
    num_outputs: int,
) -> tuple[Array, ...]:
    """Apply ``block_fn(start, size) -> tuple of [..., size]`` to consecutive time chunks, concatenated.

    Full chunks run under ``lax.map`` (one compiled body, one block live at a time) with
    ``jax.checkpoint`` so the backward pass recomputes each block's float32 softmax instead of keeping
    all of them; a ragged tail chunk is one extra static call. ``chunk_size >= num_steps`` is one direct call.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if chunk_size >= num_steps:
        # One block holds everything: nothing to save by recomputing it in the backward pass.
        return block_fn(0, num_steps)
    n_full, rem = divmod(num_steps, chunk_size)
    pieces: list[tuple[Array, ...]] = []
    if n_full:
        body = jax.checkpoint(lambda start: block_fn(start, chunk_size))
        stacked = lax.map(body, jnp.arange(n_full, dtype=jnp.int32) * chunk_size)
        pieces.append(tuple(jnp.moveaxis(a, 0, -2).reshape(*a.shape[1:-1], n_full * chunk_size) for a in stacked))
    if rem:
        pieces.append(jax.checkpoint(lambda: block_fn(n_full * chunk_size, rem))())
    return tuple(jnp.concatenate([p[i] for p in pieces], axis=-1) for i in range(num_outputs))


@overload
def token_logprobs_chunked(logits: Array, tokens: Array, *, temperature: float | Array = ..., chunk_size: int = ...,
                           with_entropy: Literal[False] = ..., logit_softcap: float | None = ...) -> Array: ...


@overload
def token_logprobs_chunked(logits: Array, tokens: Array, *, temperature: float | Array = ..., chunk_size: int = ...,
                           with_entropy: Literal[True], logit_softcap: float | None = ...) -> tuple[Array, Array]: ...


def token_logprobs_chunked(
    logits: Array,
    tokens: Array,
    *,
    temperature: float | Array = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = False,
) -> Array | tuple[Array, Array]:
    """``token_logprobs`` (and optionally ``token_entropy``) computed ``chunk_size`` positions at a time.

    Same formula as ``token_logprobs``; only a ``[B, chunk_size, V]`` float32 block exists at once (forward
    and, through rematerialisation, backward), instead of a full float32 ``[B, T, V]`` copy of bf16 logits.
    The logits themselves are still an input here; ``token_logprobs_from_hidden`` avoids them too.

    Shapes: ``logits [B, T, V]``, ``tokens [B, T]`` -> ``[B, T]`` float32 (and entropy ``[B, T]``).
    ``chunk_size`` and ``with_entropy`` are static.
    """
    time_axis = logits.ndim - 2

    def block(start: Array | int, size: int) -> tuple[Array, ...]:
        z = lax.dynamic_slice_in_dim(logits, start, size, axis=time_axis)
        tok = lax.dynamic_slice_in_dim(tokens, start, size, axis=time_axis)
        logp, ent = _logprobs_entropy_f32(z, tok, temperature, with_entropy)
        return (logp,) if ent is None else (logp, ent)

    out = _map_over_time_chunks(block, logits.shape[time_axis], chunk_size, 2 if with_entropy else 1)
    return (out[0], out[1]) if with_entropy else out[0]


@overload
def token_logprobs_from_hidden(hidden: Array, unembed: Array, tokens: Array, *, temperature: float | Array = ...,
                               chunk_size: int = ..., with_entropy: Literal[False] = ...,
                               logit_softcap: float | None = ...,
                               compute_dtype: jnp.dtype | str | None = ...,
                               unembed_transposed: bool = ...) -> Array: ...


@overload
def token_logprobs_from_hidden(hidden: Array, unembed: Array, tokens: Array, *, temperature: float | Array = ...,
                               chunk_size: int = ..., with_entropy: Literal[True],
                               logit_softcap: float | None = ...,
                               compute_dtype: jnp.dtype | str | None = ...,
                               unembed_transposed: bool = ...) -> tuple[Array, Array]: ...


def token_logprobs_from_hidden(
    hidden: Array,
    unembed: Array,
    tokens: Array,
    *,
    temperature: float | Array = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = False,
    logit_softcap: float | None = None,
    compute_dtype: jnp.dtype | str | None = None,
    unembed_transposed: bool = False,
) -> Array | tuple[Array, Array]:
    """Log-probs of ``tokens`` under ``softmax(hidden @ unembed / temperature)`` without full logits.
    With ``logit_softcap`` (Gemma 2) the logits are ``cap * tanh(hidden @ unembed / cap)`` first.

    ``logits = hidden @ unembed`` is formed ``chunk_size`` positions at a time as a ``precision.matmul``
    (operands in ``compute_dtype``, default ``unembed``'s dtype; float32 accumulation and logits), reduced
    to the token log-prob (and entropy), and discarded; the backward
    pass recomputes each chunk. Peak extra memory is ``[B, chunk_size, V]`` float32 rather than
    ``[B, T, V]``, which is what matters for 150k-token vocabularies.

    Shapes: ``hidden [B, T, D]`` (final-norm output), ``unembed [D, V]`` (the LM head, or the transposed
    embedding when tied), ``tokens [B, T]`` -> ``[B, T]`` float32 (and entropy ``[B, T]``).
    ``chunk_size`` and ``with_entropy`` are static. ``unembed_transposed``: ``unembed`` is ``[V, D]`` (a tied
    embedding as stored) and the logits are ``hidden @ unembed^T`` (``precision.matmul_transposed``): passing
    ``embedding.T`` instead works too, but XLA:CPU folds that transpose into the dot and runs it, and its
    gradient, as float32 dots (the update's largest matmul, at about a quarter of the bf16 speed).
    """
    time_axis = hidden.ndim - 2
    dtype = unembed.dtype if compute_dtype is None else compute_dtype

    def block(start: Array | int, size: int) -> tuple[Array, ...]:
        h = lax.dynamic_slice_in_dim(hidden, start, size, axis=time_axis)
        tok = lax.dynamic_slice_in_dim(tokens, start, size, axis=time_axis)
        # A 2-D matmul on [rows * size, D]: its weight gradient is then a plain GEMM (a batched einsum's gradient
        # contracts two axes, which XLA:CPU lowers through strided transposes).
        z = (matmul_transposed if unembed_transposed else matmul)(h, unembed, dtype, jnp.float32)
        z = softcap(z, logit_softcap)
        logp, ent = _logprobs_entropy_f32(z, tok, temperature, with_entropy)
        return (logp,) if ent is None else (logp, ent)

    with jax.named_scope("lm_head"):  # the profile's op kinds (bench/update_profile.py) read the scopes
        out = _map_over_time_chunks(block, hidden.shape[time_axis], chunk_size, 2 if with_entropy else 1)
    return (out[0], out[1]) if with_entropy else out[0]


def logprob_chunk_size(rows: int, length: int, vocab_size: int, block_mib: float) -> int:
    """Completion positions per log-prob chunk: the most whose float32 logits `[rows, chunk, V]` fit in
    `block_mib` MiB (at least 1); `length` (one block, no chunking) when everything fits or `block_mib == 0`."""
    if block_mib <= 0:
        return length
    return max(1, min(length, int(block_mib * 2**20) // (4 * rows * vocab_size)))
