"""The model math as pure functions, shared by the Flax decoder (`decoder.py`, training and the reference
pass), the sampler's token step (`decode.py`) and the engine: RMSNorm, rotary embeddings (with their scalings),
the masked softmax and one block of grouped-query attention (what `attention.py`'s paths call per chunk), SwiGLU.
A model family is written here once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models import precision
from jaxrl_llm.models.config import ModelConfig

# A large finite negative: a fully padded query row then gets a uniform (finite) softmax instead of NaN.
MASKED = -1e30

SUPPORTED_ROPE_SCALING = ("linear", "llama3", "yarn", "longrope")


def rms_norm(
    x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype | None = None, unit_offset: bool = False
) -> jax.Array:
    """`y = x / sqrt(mean(x^2) + eps) * scale` over the last axis, normalised in float32 (as transformers'
    LlamaRMSNorm), then scaled in `dtype` (default: `x`'s). `unit_offset` (Gemma): `* (1 + scale)`, the product
    taken in float32 before the cast, as Gemma's RMSNorm does."""
    with jax.named_scope("norm"):  # the profile's op kinds (bench/update_profile.py) read the scopes
        dtype = dtype or x.dtype
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        if unit_offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(dtype)
        return scale.astype(dtype) * normed.astype(dtype)


def embed_tokens(embedding: jax.Array, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """Token embeddings `[..., D]` in the activation dtype, times `sqrt(D)` for Gemma (`embed_scale`). The
    embedding is a weight matrix (a one-hot matmul): its rows are read in the compute dtype, as every dot
    reads its weights, so a bfloat16-stored copy gives the same activations as the float32 master. Rows are
    gathered, then cast (never the whole table)."""
    x = jnp.take(embedding, tokens, axis=0).astype(config.jnp_dtype).astype(config.jnp_activation_dtype)
    if config.embed_scale:
        x = x * jnp.asarray(config.hidden_size**0.5, x.dtype)
    return x


def gated_activation(gate: jax.Array, up: jax.Array, hidden_act: str = "silu",
                     clamp: tuple[float, float] | None = None) -> jax.Array:
    """The gated MLP's inner activation, `act(gate) * up` (the MLP is `down(act(gate(x)) * up(x))`): SwiGLU
    with `silu`, GeGLU with `gelu_pytorch_tanh` (`0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`).

    `clamp = (alpha, limit)` (gpt-oss's experts): `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    `g = min(gate, limit)`, whatever `hidden_act` says."""
    if clamp is not None:
        alpha, limit = clamp
        g = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1) * (g * jax.nn.sigmoid(alpha * g))
    if hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    return jax.nn.silu(gate) * up


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft capping, `cap * tanh(x / cap)` (identity when `cap` is None)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def masked_softmax(
    scores: jax.Array, allowed: jax.Array, scale: float, logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`softmax(softcap(scores * scale))` over the last (key) axis with disallowed keys at `MASKED`, float32
    (transformers' order: scale, soft cap, mask); `allowed` broadcastable to `scores`.

    `sinks` (gpt-oss; broadcastable to `scores[..., :1]`): one more logit per row in the denominator, with no value,
    `p_s = exp(z_s) / (sum_s' exp(z_s') + exp(sink))`, so a row's probabilities sum to less than 1."""
    logits = jnp.where(allowed, softcap(scores * scale, logit_softcap), MASKED)
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sinks = sinks.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sinks))
    p = jnp.exp(logits - top)
    return p / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sinks - top))


def head_sinks(sinks: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """Per-head sink logits `[H]` as `[KVH, H / KVH, 1]`, the grouped heads' layout of the attention scores
    (`[..., KVH, G, S]` once a leading batch axis is broadcast); None stays None."""
    return None if sinks is None else sinks.reshape(num_kv_heads, -1, 1)


def _rope_scaling_of(config: ModelConfig, local: bool) -> tuple[float, dict | None]:
    """`(theta, scaling)` of a layer kind: Gemma 3's local layers use `local_rope_theta` unscaled."""
    if local and config.local_rope_theta is not None:
        return config.local_rope_theta, None
    return config.rope_theta, config.rope_scaling_dict


def rotary_dim(config: ModelConfig) -> int:
    """How many leading dims of each head RoPE rotates: `int(head_dim * partial_rotary_factor)`."""
    return int(config.head_dim * config.partial_rotary_factor)


def rope_parameters(config: ModelConfig, local: bool = False) -> tuple[np.ndarray, np.ndarray | None, int, float]:
    """`(inv_freq [rot/2], long_inv_freq or None, original_max_positions, attention_factor)` per transformers'
    `modeling_rope_utils`: base frequencies `theta^(-2i/rot)`, adjusted by the scaling type;
    `long_inv_freq` (longrope only) replaces `inv_freq` when a batch reaches past `original_max_positions`;
    `attention_factor` multiplies cos and sin (yarn, longrope; 1 otherwise)."""
    theta, scaling = _rope_scaling_of(config, local)
    dim = rotary_dim(config)
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    inv_freq = (1.0 / (theta ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq, None, 0, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).astype(np.float32), None, 0, 1.0
    original = int(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / original
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), None, original, 1.0
    if kind == "yarn":
        return _yarn(scaling, theta, dim, factor, original, inv_freq)
    if kind == "longrope":
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        base = (theta ** exponents).astype(np.float32)
        short = (1.0 / (np.asarray(scaling["short_factor"], np.float32) * base)).astype(np.float32)
        long = (1.0 / (np.asarray(scaling["long_factor"], np.float32) * base)).astype(np.float32)
        return short, long, original, float(attention)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_SCALING)}")


def _yarn(scaling: dict, theta: float, dim: int, factor: float, original: int, inv_freq: np.ndarray) -> tuple:
    """YaRN (Peng et al. 2023): per-dimension blend of interpolated (`inv_freq / factor`) and extrapolated
    frequencies by a linear ramp between the correction dims of `beta_fast` and `beta_slow` rotations, and the
    attention factor `0.1 ln(factor) + 1` (or `mscale`'s ratio)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all
                     else get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv.astype(np.float32), None, original, float(attention)


def rope_cos_sin(config: ModelConfig, positions: jax.Array, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """`cos, sin [..., rot]` for integer `positions [...]`, computed in float32 and multiplied by the attention
    factor. Longrope picks its long factors for the whole batch when `max(positions) + 1` exceeds the original
    context (as transformers' dynamic update does, per forward call)."""
    inv, long_inv, original, attention = rope_parameters(config, local)
    inv_freq = jnp.asarray(inv)
    if long_inv is not None:
        inv_freq = jnp.where(jnp.max(positions) + 1 > original, jnp.asarray(long_inv), inv_freq)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., rot/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if attention == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * attention, jnp.sin(emb) * attention


def rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`x * cos + rotate_half(x) * sin` (HF convention: the two halves of each head are the pairs), with
    `cos, sin` broadcastable to `x [..., hd]` (cast to `x`'s dtype). With `cos [..., rot]`, `rot < hd` (partial
    rotary), only the first `rot` dims rotate and the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return jnp.concatenate([rotary(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`rotary` for `x [B, T, heads, hd]` with `cos, sin [B, T, hd]` (one rotation per position)."""
    return rotary(x, cos[:, :, None, :], sin[:, :, None, :])


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions `[B, T]` of a left-padded batch: `cumsum(mask) - 1`, 0 on padding."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def attention_block(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, scale: float,
                    logit_softcap: float | None, compute_dtype: jnp.dtype | str,
                    sinks: jax.Array | None = None) -> jax.Array:
    """`softmax(softcap(scale * q k^T) | allowed) v` of `q [B, T, H, hd]`, `k, v [B, S, KVH, hd]`, `allowed [B, T,
    S]` -> `[B, T, H * hd]`: queries grouped `[B, T, KVH, G, hd]` against their shared key head, scores
    `[B, KVH, G, T, S]` in float32."""
    b, t, h, hd = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, h // kvh, hd)
    scores = precision.einsum("btkgd,bskd->bkgts", q, k, compute_dtype, jnp.float32)
    grouped = head_sinks(sinks, kvh)  # [KVH, G, 1] -> [KVH, G, 1, 1] against scores [B, KVH, G, T, S]
    probs = masked_softmax(scores, allowed[:, None, None], scale, logit_softcap,
                           None if grouped is None else grouped[..., None])
    out = precision.einsum("bkgts,bskd->btkgd", probs, v, compute_dtype)
    return out.reshape(b, t, h * hd)


