"""Mixture-of-experts feed-forward math: top-k routing (with replay of a recorded selection), the experts computed
dropless with grouped matmuls (`jax.lax.ragged_dot`), a dense reference, and the load-balancing loss.

Shapes: tokens flattened to `x [N, D]`; `E` experts of intermediate size `I`, each a gated MLP
`down_e(act(x gate_e) * (x up_e))` with `gate, up [E, D, I]` and `down [E, I, D]`; `k` experts per token.

    probs   = softmax(x W_router)                              [N, E] float32
    experts = top_k(probs)  (or the recorded selection: replay) [N, k] int32
    weights = probs[experts] (/ their sum, if renormalized)     [N, k] float32
    y       = sum_j weights_j * expert_{experts_j}(x)           [N, D]

Under replay the selection is data but the weights are still gathered from the live router's probabilities, so
the router gets its gradient (R3, arXiv 2510.11370): where the replayed and the live selections agree, the
function, and so its gradient, is the live router's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models import precision
from jaxrl_llm.models.layers import gated_activation
from jaxrl_llm.sharding import BATCH_AXES, fit_spec

NO_RECORD = -1  # a token whose experts were not recorded (replay falls back to the live router for it)


class Routing(NamedTuple):
    """What one MoE layer's router did on `[..., ]` tokens: `experts [..., k]` int32, the chosen expert ids in
    the order of their probability, and the router's float32 `logits [..., E]` (for the load-balancing loss and the
    routing metrics)."""

    experts: jax.Array
    logits: jax.Array


def route(logits: jax.Array, k: int, *, renormalize: bool, replay: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: `(experts [..., k] int32, weights [..., k] float32)` from router `logits [..., E]`.

    ``probs = softmax(logits)`` in float32; the experts are ``top_k(probs)``, or, with ``replay [..., k]``, the
    replayed ids (a token whose record is ``NO_RECORD`` keeps its live top-k); ``weights = probs[experts]``,
    divided by their sum when ``renormalize`` (Mixtral always; Qwen-MoE and OLMoE by ``norm_topk_prob``).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probs, k)
    if replay is not None:
        recorded = replay[..., :1] != NO_RECORD
        experts = jnp.where(recorded, replay.astype(experts.dtype), experts)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


class Experts(NamedTuple):
    """The experts' weights: `gate, up [E, D, I]`, `down [E, I, D]` (any float dtype; cast to the compute dtype),
    and gpt-oss's biases `gate_bias, up_bias [E, I]`, `down_bias [E, D]` (added in float32; None elsewhere)."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array | None = None
    up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def _plus_bias(y: jax.Array, bias: jax.Array | None, expert: jax.Array) -> jax.Array:
    """`y [..., N]` float32 plus row-wise `bias[expert] ([E, N] gathered by expert [...])`, or `y` without a bias."""
    return y if bias is None else y + bias.astype(jnp.float32)[expert]


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`grouped_matmul` (the experts' rows of `x [M, K]`, sorted by expert, times their matrices `w [E, K, N]`)."""
    return grouped_matmul(x.astype(dtype), w.astype(dtype), sizes)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, *, tiled: bool | None = None,
                   tile: int | None = None) -> jax.Array:
    """``y[rows of group e] = x[rows of group e] @ w[e]``: rows sorted by group, ``sizes [E]`` rows each (their sum
    at most ``M``; rows past it are no group's and come out 0); float32 accumulation and output.

    Where JAX ships a grouped matmul (GPU, TPU), `jax.lax.ragged_dot`. XLA:CPU has none: it lowers `ragged_dot` to
    every group on every row, masked (the dense cost), and its backward asks for a bf16 x bf16 -> f32 dot it cannot
    run. There (``tiled``, default on the CPU) every group is padded to a multiple of ``tile`` rows, so each tile of
    rows belongs to one group, and a `lax.scan` over the tiles multiplies each by its group's matrix: the work of the
    real rows plus at most ``E * (tile - 1)`` padding rows, with plain dots (their backward too).

    Shapes: ``x [M, K]``, ``w [E, K, N]``, ``sizes [E]`` int32 -> ``[M, N]`` float32.
    """
    if not (jax.default_backend() == "cpu" if tiled is None else tiled):
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    m, groups = x.shape[0], w.shape[0]
    if tile is None:  # about a group's share of the rows, a power of two in [8, 128]: little padding, few tiles
        tile = int(min(128, max(8, 1 << max(0, (m // groups).bit_length() - 1))))
    padded = -(-sizes // tile) * tile  # each group's rows, padded to whole tiles
    starts = jnp.cumsum(padded) - padded
    firsts = jnp.cumsum(sizes) - sizes
    tiles = -(-(m + groups * (tile - 1)) // tile)  # a bound on the padded tiles, static
    rows = jnp.arange(tiles * tile)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), rows, side="right"), groups - 1)
    local = rows - starts[group]
    source = jnp.where(local < sizes[group], firsts[group] + local, m)  # m: a zero row (padding, or past the end)
    x_padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[source].reshape(tiles, tile, -1)

    def one(_: None, inputs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        block, g = inputs
        return None, precision.einsum("tk,kn->tn", block, w[g], x.dtype, jnp.float32)  # its backward too

    _, y = jax.lax.scan(one, None, (x_padded, group[::tile]))
    y = y.reshape(tiles * tile, -1)
    # Row i of group e sits at padded row starts[e] + (i - firsts[e]); rows of no group are 0.
    row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right"), groups - 1)
    at = starts[row_group] + jnp.arange(m) - firsts[row_group]
    inside = jnp.arange(m) < jnp.sum(sizes)
    return jnp.where(inside[:, None], y[jnp.where(inside, at, 0)], 0.0)


def experts_ragged(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts, *, hidden_act: str = "silu",
                   clamp: tuple[float, float] | None = None, valid: jax.Array | None = None,
                   dtype: jnp.dtype | str = jnp.float32, out_dtype: jnp.dtype | str | None = None,
                   first_expert: jax.Array | int = 0) -> jax.Array:
    """``y_n = sum_j weights_nj * expert_{experts_nj}(x_n)`` dropless, by grouped matmuls.

    The `N * k` (token, expert) assignments are sorted by expert, so each expert's tokens are one contiguous group
    of rows; `jax.lax.ragged_dot` multiplies every group by its expert's matrix (no capacity, no token dropped, no
    `[N, E, ...]` intermediate), and the weighted rows are summed back per token. A token with ``valid`` false
    (padding) is sent past the last expert: it is in no group and gets 0.

    ``w`` may hold a contiguous slice of the experts, ids ``first_expert ..`` (one device's under expert
    parallelism, `experts_parallel`): assignments to any other expert are left out like padding, so the result
    is those experts' share of ``y``.

    Each expert is ``down(act(gate x + b_gate) * (up x + b_up)) + b_down`` (biases: gpt-oss's, where ``w`` has them;
    ``act`` per `layers.gated_activation` with ``hidden_act`` and ``clamp``).

    Shapes: ``x [N, D]``, ``experts, weights [N, k]``, ``valid [N]`` -> ``[N, D]`` in ``out_dtype`` (default
    ``x``'s). Operands in ``dtype``, float32 accumulation (the precision policy of `precision.matmul`).
    """
    n, k = experts.shape
    num_experts = w.gate.shape[0]
    flat = experts.reshape(-1) - first_expert
    keep = (flat >= 0) & (flat < num_experts)
    if valid is not None:
        keep = keep & jnp.repeat(valid, k)
    flat = jnp.where(keep, flat, num_experts)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    rows = x[token]
    dtype = jnp.dtype(dtype)
    row_expert = jnp.minimum(flat[order], num_experts - 1)  # rows of no expert borrow the last one's bias: dropped
    gate = _plus_bias(_ragged(rows, w.gate, sizes, dtype), w.gate_bias, row_expert)
    up = _plus_bias(_ragged(rows, w.up, sizes, dtype), w.up_bias, row_expert)
    h = gated_activation(gate, up, hidden_act, clamp)
    y = _plus_bias(_ragged(h.astype(dtype), w.down, sizes, dtype), w.down_bias, row_expert)  # [N * k, D] float32
    routed = flat[order] < num_experts
    y = jnp.where(routed[:, None], y * weights.reshape(-1)[order][:, None].astype(jnp.float32), 0.0)
    out = jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y)
    return out.astype(out_dtype or x.dtype)


def experts_parallel(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts, mesh: Mesh, *,
                     hidden_act: str = "silu", clamp: tuple[float, float] | None = None,
                     valid: jax.Array | None = None, dtype: jnp.dtype | str = jnp.float32,
                     out_dtype: jnp.dtype | str | None = None) -> jax.Array:
    """`experts_ragged` with the experts split over the mesh's ``expert`` axis (size ``n``): the device at position
    ``i`` of that axis holds experts ``[i E/n, (i+1) E/n)`` (``w`` sharded on its expert dimension, as
    `sharding.PARTITION_RULES` places it). Tokens come split over the batch axes, `expert` among them (where they
    divide ``N``; else whole);
    each device all-gathers its expert group's tokens, runs its own experts on the assignments routed to them
    (`experts_ragged` with ``first_expert = i E/n``), and the shares are summed over the group and scattered back
    to the devices that own the tokens (``psum_scatter``): dropless, and the same sum as one device's. Expert
    weights enter whole per device (gathered over ``fsdp`` and ``tensor`` at the boundary, as FSDP gathers a
    weight where it is used).

    Shapes as `experts_ragged`'s.
    """
    n_expert = mesh.shape["expert"]
    num_experts = w.gate.shape[0]
    if num_experts % n_expert:
        raise ValueError(f"{num_experts} experts do not split over mesh axis expert={n_expert}")
    local = num_experts // n_expert
    valid = jnp.ones(x.shape[0], bool) if valid is None else valid
    row = fit_spec(PartitionSpec(BATCH_AXES), x.shape[:1], mesh)
    split = row[0] is not None  # tokens split over the batch axes, `expert` among them: gather, then scatter
    weight = PartitionSpec("expert")

    def shard(x: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array, w: Experts) -> jax.Array:
        if split:
            x, experts, weights, valid = (jax.lax.all_gather(a, "expert", tiled=True)
                                          for a in (x, experts, weights, valid))
        part = experts_ragged(x, experts, weights, w, hidden_act=hidden_act, clamp=clamp, valid=valid, dtype=dtype,
                              out_dtype=jnp.float32, first_expert=jax.lax.axis_index("expert") * local)
        if split:
            return jax.lax.psum_scatter(part, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(part, "expert")

    w_spec = Experts(*(None if a is None else weight for a in w))
    y = jax.shard_map(shard, mesh=mesh, in_specs=(row, row, row, row, w_spec),
                      out_specs=row, check_vma=False)(x, experts, weights, valid, w)
    return y.astype(out_dtype or x.dtype)


def _combine(experts: jax.Array, weights: jax.Array, num_experts: int, valid: jax.Array | None) -> jax.Array:
    """The top-k weights as a dense `[N, E]` float32 matrix (0 off each token's top-k, and on tokens not `valid`)."""
    n = experts.shape[0]
    combine = jnp.zeros((n, num_experts), jnp.float32).at[jnp.arange(n)[:, None], experts].add(
        weights.astype(jnp.float32))
    return combine if valid is None else jnp.where(valid[:, None], combine, 0.0)


def experts_dense(x: jax.Array, experts: jax.Array, weights: jax.Array, w: Experts, *, hidden_act: str = "silu",
                  clamp: tuple[float, float] | None = None, valid: jax.Array | None = None,
                  dtype: jnp.dtype | str = jnp.float32, out_dtype: jnp.dtype | str | None = None) -> jax.Array:
    """The same function as `experts_ragged`, computed the plain way for tests: every expert on every token
    (``[N, E, I]`` and ``[N, E, D]`` intermediates), combined with a dense ``[N, E]`` matrix of the top-k weights."""
    num_experts = w.gate.shape[0]
    dtype = jnp.dtype(dtype)
    combine = _combine(experts, weights, num_experts, valid)
    every = jnp.arange(num_experts)[None]  # [1, E]: each token through every expert
    gate = _plus_bias(precision.einsum("nd,edi->nei", x, w.gate, dtype, jnp.float32), w.gate_bias, every)
    up = _plus_bias(precision.einsum("nd,edi->nei", x, w.up, dtype, jnp.float32), w.up_bias, every)
    h = gated_activation(gate, up, hidden_act, clamp)
    y = _plus_bias(precision.einsum("nei,eid->ned", h, w.down, dtype, jnp.float32), w.down_bias, every)
    return jnp.einsum("ne,ned->nd", combine, y).astype(out_dtype or x.dtype)


class FusedExperts(NamedTuple):
    """Every expert as one matrix, for the samplers' token steps on the CPU (`fused_experts`): `gate_up [D, E * 2I]`
    (expert e's gate columns, then its up columns, at `e * 2I`), `down [E * I, D]`, and gpt-oss's biases
    `gate_up_bias [E * 2I]` float32 and `down_bias [E, D]` float32 (None elsewhere)."""

    gate_up: jax.Array
    down: jax.Array
    gate_up_bias: jax.Array | None = None
    down_bias: jax.Array | None = None


def fuse_experts(w: Experts, dtype: jnp.dtype | str) -> FusedExperts:
    """`Experts` in `FusedExperts`' layout (matrices in `dtype`): one copy of the experts' weights, made once per
    sampling call."""
    e, d, i = w.gate.shape
    gate_up = jnp.concatenate([w.gate, w.up], axis=-1).transpose(1, 0, 2).reshape(d, e * 2 * i).astype(dtype)
    bias = None
    if w.gate_bias is not None and w.up_bias is not None:
        bias = jnp.concatenate([w.gate_bias, w.up_bias], axis=-1).reshape(-1).astype(jnp.float32)
    down_bias = None if w.down_bias is None else w.down_bias.astype(jnp.float32)
    return FusedExperts(gate_up, w.down.reshape(e * i, d).astype(dtype), bias, down_bias)


def fused_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w: FusedExperts, num_experts: int, *,
                  hidden_act: str = "silu", clamp: tuple[float, float] | None = None, valid: jax.Array | None = None,
                  dtype: jnp.dtype | str = jnp.float32, out_dtype: jnp.dtype | str | None = None) -> jax.Array:
    """The same function as `experts_ragged`, as two plain matmuls over all ``num_experts`` experts:
    ``h = act(x gate_up)`` ``[N, E, I]``, scaled by each token's dense ``[N, E]`` top-k weights (0 off its top-k),
    then ``h down`` (plus the top-k weights times the down biases).

    ``E / k`` times the routed flops, but each expert's weights are read once, by one matmul: where a step's tokens
    reach most experts anyway (a sampler's step), XLA:CPU runs this faster than the grouped matmul's tiles of a few
    rows (`step_weights.fused_step_experts` says where the samplers use it; bench/README.md has the figures).

    Shapes: ``x [N, D]``, ``experts, weights [N, k]``, ``valid [N]`` -> ``[N, D]`` in ``out_dtype`` (default
    ``x``'s). Operands in ``dtype``, float32 accumulation.
    """
    n, e = x.shape[0], num_experts
    size = w.down.shape[0] // e
    combine = _combine(experts, weights, e, valid)
    gate_up = precision.einsum("nd,df->nf", x, w.gate_up, dtype, jnp.float32)
    if w.gate_up_bias is not None:
        gate_up = gate_up + w.gate_up_bias
    gate_up = gate_up.reshape(n, e, 2 * size)
    h = gated_activation(gate_up[..., :size], gate_up[..., size:], hidden_act, clamp) * combine[..., None]
    y = precision.einsum("nf,fd->nd", h.reshape(n, e * size), w.down, dtype, jnp.float32)
    if w.down_bias is not None:
        y = y + combine @ w.down_bias
    return y.astype(out_dtype or x.dtype)


def load_balancing_loss(router_logits: jax.Array, k: int, mask: jax.Array | None = None) -> jax.Array:
    """The auxiliary load-balancing loss as transformers computes it (Switch Transformer, Fedus et al. 2021, eq. 4;
    `load_balancing_loss_func` of the Mixtral / Qwen-MoE / OLMoE models), over every layer's tokens together::

        f_e = (top-k assignments to e) / rows,   P_e = sum_rows softmax(logits)_e / rows,   loss = E * sum_e f_e P_e

    Shapes: ``router_logits [L, N, E]`` (or ``[N, E]``), ``mask [N]`` (1 = a real token; padding counts nowhere)
    -> scalar float32. Its gradient reaches the router through ``P`` only (the counts are a selection).
    """
    logits = router_logits.astype(jnp.float32)
    if logits.ndim == 2:
        logits = logits[None]
    num_experts = logits.shape[-1]
    m = jnp.ones(logits.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32).reshape(-1)
    probs = jax.nn.softmax(logits, axis=-1)  # [L, N, E]
    _, chosen = jax.lax.top_k(probs, k)  # [L, N, k]
    counts = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32) * m[None, :, None, None], axis=(0, 1, 2))
    rows = logits.shape[0] * jnp.sum(m)
    prob_sum = jnp.sum(probs * m[None, :, None], axis=(0, 1))
    return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


def expert_load(experts: jax.Array, num_experts: int, mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per layer, ``(max, mean)`` over experts of the tokens routed to each: ``experts [L, N, k]``, ``mask [N]`` ->
    two ``[L]`` float32 arrays (``max / mean`` is 1 for a perfectly balanced layer, ``E / k`` for a collapsed one)."""
    m = jnp.ones(experts.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32).reshape(-1)
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * m[None, :, None, None], axis=(1, 2))
    return jnp.max(counts, axis=-1), jnp.mean(counts, axis=-1)


def routing_confidence(router_logits: jax.Array, k: int, mask: jax.Array | None = None) -> jax.Array:
    """Per layer, the mean over tokens of the probability mass of the top-k experts: ``router_logits [L, N, E]``,
    ``mask [N]`` -> ``[L]`` float32 (``k / E`` for a uniform router, 1 for a certain one)."""
    top, _ = jax.lax.top_k(jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1), k)
    mass = jnp.sum(top, axis=-1)  # [L, N]
    m = jnp.ones(mass.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32).reshape(-1)
    return jnp.sum(mass * m, axis=-1) / jnp.maximum(jnp.sum(m), 1.0)


def router_disagreement(a: jax.Array, b: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Per layer, the fraction of tokens whose *sets* of top-k experts differ between two selections
    ``a, b [L, N, k]`` (order within the k ignored), over ``mask [N]`` -> ``[L]`` float32."""
    same = jnp.all(jnp.sort(a, axis=-1) == jnp.sort(b, axis=-1), axis=-1)  # [L, N]
    m = jnp.ones(same.shape[1], jnp.float32) if mask is None else mask.astype(jnp.float32).reshape(-1)
    return jnp.sum((~same) * m, axis=-1) / jnp.maximum(jnp.sum(m), 1.0)
