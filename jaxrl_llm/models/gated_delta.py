"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next, as pure functions.

Per value head, a state `S [dk, dv]` (float32) is decayed, corrected and read at every token `t`:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - k_t^T exp(g_t) S_{t-1})^T        (the gated delta rule)
    o_t = S_t^T q_t

with `q, k` L2-normalised (q also scaled by `dk^-1/2`), the decay `g_t <= 0` and the write strength `beta_t in (0, 1)`.
Before it, a short causal depthwise convolution (`causal_conv`, kernel `K`, SiLU) mixes the last `K` inputs of q, k
and v; after it, a gated RMSNorm (`gated_rms_norm`) and the output projection (`sublayers.LinearAttention`).

Two forms of the same rule:
- `recurrent_gated_delta_rule`: token by token (`lax.scan`): the decode step, and the tests' reference;
- `chunked_gated_delta_rule`: the training forward and the prefill. Within a chunk of `C` tokens (64) the corrections
  are one small unit-lower-triangular system, `(I + L) U = V_beta - W S_0` (the UT transform of DeltaNet's paper),
  solved by forward substitution (`unit_lower_inverse`);
  across chunks only the state is carried, by `lax.scan`, each chunk's body rematerialised in the backward pass, so
  the backward keeps one state per chunk, not one per token.

Sequences are told apart by `segments [B, T]` (packed rows: one id per sequence; left-padded rows: 0 on the padding,
1 after): no token reads the convolution window or the state of another segment; each segment starts from a zero
state, the first one from `initial_state` (a cached state: a prefill that continues a sequence).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

CHUNK = 64  # tokens per chunk of the chunked form (FLA's and transformers' default)


class LinearState(NamedTuple):
    """What a linear-attention layer carries from call to call: the convolution's window (its last `K - 1` inputs,
    `conv [B, K - 1, C]`) and the recurrent state `recurrent [B, Hv, dk, dv]` float32. Its size does not depend on
    the sequence's length."""

    conv: jax.Array
    recurrent: jax.Array


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x / sqrt(sum(x^2) + eps)` over the last axis (FLA's and transformers' `l2norm`)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x: jax.Array, scale: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """`scale * x / sqrt(mean(x^2) + eps) * silu(gate)` over the last axis, in float32, cast to `x`'s dtype
    (transformers' `Qwen3_5RMSNormGated`: the norm before the gate)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def causal_conv(x: jax.Array, weight: jax.Array, state: jax.Array | None = None,
                segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise convolution with SiLU: `y[t, c] = silu(sum_j weight[j, c] x[t - K + 1 + j, c])` over
    `x [B, T, C]`, `weight [K, C]`, inputs before the row (or of another segment) counting as zero; `state
    [B, K - 1, C]` (None: zeros): the inputs that precede the row, which belong to its first segment. Returns `(y
    [B, T, C], the new state: the last K - 1 inputs [B, K - 1, C])`. Operands in `x`'s dtype, summed in float32."""
    b, t, c = x.shape
    k = weight.shape[0]
    prior = jnp.zeros((b, k - 1, c), x.dtype) if state is None else state.astype(x.dtype)
    padded = jnp.concatenate([prior, x], axis=1)  # [B, K - 1 + T, C]
    if segments is None:
        seg = jnp.zeros((b, k - 1 + t), jnp.int32)
        own = seg[:, k - 1:]
    else:
        own = segments.astype(jnp.int32)
        seg = jnp.concatenate([jnp.broadcast_to(own[:, :1], (b, k - 1)), own], axis=1)
    acc = jnp.zeros((b, t, c), jnp.float32)
    for j in range(k):  # K (4) shifted multiply-adds: no [B, T, K, C] window materialised
        window = padded[:, j:j + t].astype(jnp.float32)
        keep = (seg[:, j:j + t] == own)[..., None]
        acc = acc + jnp.where(keep, window, 0.0) * weight[j].astype(jnp.float32)
    return jax.nn.silu(acc).astype(x.dtype), padded[:, t:]


def _prepare(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32 `[B, Hv, T, ...]` operands: q and k repeated to the value heads (each key head serves `Hv / Hk`
    consecutive value heads), L2-normalised, q scaled by `dk^-1/2`."""
    rep = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(a, rep, axis=2) if rep > 1 else a for a in (q, k))
    q, k, v = (jnp.swapaxes(a.astype(jnp.float32), 1, 2) for a in (q, k, v))
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    g, beta = (jnp.swapaxes(a.astype(jnp.float32), 1, 2) for a in (g, beta))
    return q, k, v, g, beta


@jax.custom_vjp
def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """`(I + L)^-1` of strictly lower-triangular `L [..., C, C]` by forward substitution, one row at a time: with
    `A = -L`, row `i` becomes `A_i + A_i A` (rows above it already final), then `+ I`: plain matmuls in a loop of `C`
    steps (no LAPACK call, which XLA:CPU runs on threads of its own). Its gradient is the inverse's,
    `dL = -strictly_lower(T^T dT T^T)` with `T` the result, so the loop keeps nothing for the backward pass."""
    c = lower.shape[-1]
    rows = jnp.arange(c)

    def row(i: jax.Array, a: jax.Array) -> jax.Array:
        current = jnp.take(a, i, axis=-2)  # [..., C]
        updated = current + jnp.einsum("...k,...kj->...j", current, a)
        return jnp.where((rows == i)[:, None], updated[..., None, :], a)

    return jax.lax.fori_loop(1, c, row, -lower) + jnp.eye(c, dtype=lower.dtype)


def _inverse_forward(lower: jax.Array) -> tuple[jax.Array, jax.Array]:
    inverse = unit_lower_inverse(lower)
    return inverse, inverse


def _inverse_backward(inverse: jax.Array, grad: jax.Array) -> tuple[jax.Array]:
    t = jnp.swapaxes(inverse, -1, -2)
    return (-jnp.tril(t @ grad @ t, -1),)


unit_lower_inverse.defvjp(_inverse_forward, _inverse_backward)


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               initial_state: jax.Array | None = None, segments: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """The module docstring's rule token by token. `q, k [B, T, Hk, dk]`, `v [B, T, Hv, dv]`, `g, beta [B, T, Hv]`,
    `initial_state [B, Hv, dk, dv]` (None: zeros), `segments [B, T]` (a token of a new segment starts from a zero
    state). Returns `(o [B, T, Hv, dv]` in `v`'s dtype, `the final state [B, Hv, dk, dv]` float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if initial_state is None else initial_state
    seg = jnp.zeros((b, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
    reset = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)  # [B, T]

    def step(s: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t, r_t = xs  # [B, H, d], [B, H], [B]
        s = jnp.where(r_t[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, g, beta)) + (reset.T,)
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(dtype), state  # [T, B, H, dv] -> [B, T, H, dv]


def chunked_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                             initial_state: jax.Array | None = None, segments: jax.Array | None = None,
                             chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """`recurrent_gated_delta_rule` (same arguments and result) in chunks of `chunk` tokens. Per chunk, with
    `c_i = cumsum(g)_i` and `D_ij = exp(c_i - c_j)` for `j <= i` in the same segment (else 0):

        (I + L) U = V beta - (K beta exp(c) m) S_0,   L_ij = beta_i k_i.k_j D_ij  (j < i)
        O = (Q exp(c) m) S_0 + ((Q K^T) * D) U
        S_C = exp(c_C) m_C S_0 + sum_j [seg_j = seg_C] exp(c_C - c_j) k_j U_j^T

    `m_i`: token i is in the segment of the state carried into the chunk. The tail is padded to whole chunks with
    `g = 0, k = v = 0`, which changes neither the outputs nor the state."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    seg = jnp.zeros((b, t), jnp.int32) if segments is None else segments.astype(jnp.int32)
    pad = -t % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")  # the padding joins the last segment (k = 0: inert)
    n = (t + pad) // chunk
    q, k, v = (a.reshape(b, h, n, chunk, -1) for a in (q, k, v))
    g, beta = (a.reshape(b, h, n, chunk) for a in (g, beta))
    seg = seg.reshape(b, 1, n, chunk)
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = (seg[..., :, None] == seg[..., None, :]) & causal  # [B, 1, N, C, C]
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # Tokens a chunk's incoming state reaches: a chunk's state belongs to the segment of the token before it.
    entering = jnp.concatenate([seg[..., :1, :1], seg[..., :-1, -1:]], axis=2)  # [B, 1, N, 1]
    reach = seg == entering  # [B, 1, N, C]
    system = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k) * decay * (1 - jnp.eye(chunk))  # L (strictly lower)
    inverse = unit_lower_inverse(system)  # (I + L)^-1
    u = jnp.einsum("bhnij,bhnjd->bhnid", inverse, v_beta)  # [B, H, N, C, dv]
    w = jnp.einsum("bhnij,bhnjd->bhnid", inverse, k_beta * (jnp.exp(cum) * reach)[..., None])  # [B, H, N, C, dk]
    q_in = q * (jnp.exp(cum) * reach)[..., None]
    intra = jnp.einsum("bhnid,bhnjd->bhnij", q, k) * decay
    last = seg[..., -1:]
    k_out = k * (jnp.exp(cum[..., -1:] - cum) * (seg == last))[..., None]  # [B, H, N, C, dk]
    keep = jnp.exp(cum[..., -1]) * reach[..., -1]  # [B, H, N]

    @jax.checkpoint
    def body(s: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        u_n, w_n, q_n, a_n, k_n, keep_n = xs
        new = u_n - jnp.einsum("bhcd,bhdv->bhcv", w_n, s)
        out = jnp.einsum("bhcd,bhdv->bhcv", q_n, s) + jnp.einsum("bhij,bhjv->bhiv", a_n, new)
        return s * keep_n[..., None, None] + jnp.einsum("bhcd,bhcv->bhdv", k_n, new), out

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u, w, q_in, intra, k_out, keep))
    state, out = jax.lax.scan(body, state, xs)  # out [N, B, H, C, dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.swapaxes(out, 1, 2).astype(dtype), state
