"""The padding-free update: a micro-batch's sequences laid end to end in packed rows.

A policy micro-batch is `M` sequences in the padded layout: the model reads `inputs = concat(prompt,
completion)[:, :-1]`, `[M, S]` with `S = P + T - 1`, left-padded prompts and right-padded completions. Packed,
the valid input tokens of several sequences share a row of the same length `S`::

    row r:  [ seq 3 ............ | seq 0 ....... | seq 5 .. | pad ]     segments 4 4 4 1 1 1 6 6 0
                                                                        positions 0 1 2 0 1 2 0 1 0

Attention stays inside a sequence (block-diagonal causal from the segment ids, `models/attention.py`), RoPE positions
restart per sequence, so every packed position's hidden state is the padded one's. The losses do not change: the
hidden states that predict the completion tokens are gathered back to `[M, T]` (`PackedLayout.predictor`) and
everything after that (log-probs, KL, entropy, every aggregation mode, GSPO's sequence ratios, the rollout
correction's weights, per-turn credit) runs on the padded `[M, T]` arrays as before.

Host side (numpy, before the update's jit): `first_fit_decreasing` bins sequences by length, `micro_batch_layout`
lays out one micro-batch, `update_layouts` every micro-batch of every update of a step, in the row order the
update's strided micro-batch split reads. Rows per micro-batch are rounded up to a multiple of `M // 8`
(`bucket_rows`), so a run compiles at most 8 update programs. Device side (pure, jittable): `packed_inputs`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.layers import positions_from_mask


class PackedLayout(NamedTuple):
    """Where one micro-batch's sequences sit in its `R` packed rows of length `S`.

    source `[R, S]` int32: for each packed position, the flat index `m * S + s` of the input token it holds in the
    padded `[M, S]` inputs, -1 on padding. predictor `[M, T]` int32: for each completion token `t` of sequence `m`,
    the flat packed index `r * S + j` of the position whose hidden state predicts it (0 where the completion mask
    is 0: those log-probs are masked downstream). Stacked over micro-batches (and updates), the leading axes grow.
    """

    source: jax.Array
    predictor: jax.Array


def packing_pays(padded_positions: int, num_params: int, min_gflops: float) -> bool:
    """Whether packing a micro-batch of `padded_positions` (rows x row length, padded) can pay for itself: its
    padded forward's matmul work `2 * num_params * padded_positions` is at least `min_gflops` GFLOP. Below that an
    update is bound by dispatch and compilation rather than by the padding it computes (measured, docs/packing.md:
    the default task's 0.59M model, 3 GFLOP a micro-batch, updated in the same time packed or padded and compiled
    up to 8 more programs; SmolLM2-135M on GSM8K, 1,650 GFLOP, 1.27x faster packed)."""
    return 2.0 * num_params * padded_positions >= min_gflops * 1e9


def first_fit_decreasing(lengths: np.ndarray | list[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most `capacity`: longest first, each into the first bin
    it fits (at most 11/9 OPT + 1 bins). Zero-length sequences are left out; a longer one than `capacity` is an
    error (a row holds the longest padded sequence, so it cannot happen for a rollout)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        if n == 0:
            continue
        if n > capacity:
            raise ValueError(f"first_fit_decreasing: a sequence of {n} tokens does not fit a row of {capacity}")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def bucket_rows(needed: int, most: int, multiple: int = 1) -> int:
    """Rows to allocate for `needed` bins out of at most `most`: rounded up to a multiple of `most // 8`, so a run
    compiles at most 8 shapes of its update, each at most 1/8 of the rows over what it needs; then to a multiple of
    `multiple` (the data-parallel devices the rows are split over, which divide `most`)."""
    step = max(1, most // 8)
    return min(most, -(-(-(-needed // step) * step) // multiple) * multiple)


def micro_batch_layout(valid: np.ndarray, prompt_width: int, rows: int, row_len: int | None = None,
                       bins: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(source [rows, row_len], predictor [M, T])` of one micro-batch from its input mask `valid [M, S]` (the
    padded inputs' attention mask, `S = P + T - 1`) and the prompt width `P`; rows of `row_len >= S` tokens
    (default `S`). Sequences are binned by `first_fit_decreasing` (unless its `bins` are given) and laid out in bin
    order, each as its valid positions in order."""
    m, s = valid.shape
    t = s - prompt_width + 1
    row_len = s if row_len is None else row_len
    bins = first_fit_decreasing(valid.sum(axis=1), row_len) if bins is None else bins
    if len(bins) > rows:
        raise ValueError(f"micro_batch_layout: {len(bins)} bins do not fit {rows} rows")
    source = np.full((rows, row_len), -1, np.int32)
    where = np.zeros((m, s), np.int64)  # flat packed index of each valid input position
    for r, members in enumerate(bins):
        j = 0
        for i in members:
            cols = np.flatnonzero(valid[i])
            source[r, j : j + len(cols)] = i * s + cols
            where[i, cols] = r * row_len + np.arange(j, j + len(cols))
            j += len(cols)
    # completion token t is predicted at input column P - 1 + t
    predictor = np.where(valid[:, prompt_width - 1 : prompt_width - 1 + t], where[:, prompt_width - 1:], 0)
    return source, predictor.astype(np.int32)


def row_length(valid: np.ndarray, row_tokens: int) -> int:
    """The packed rows' length: the padded length `S` (the longest sequence fits a row), or `row_tokens` if longer.
    Longer rows pack tighter but every position attends over the whole row: on the 2-core CPU, rows of `2 S` made
    an update of SmolLM2 no faster than padded, rows of `S` 1.25x faster (`bench/packing.py`)."""
    return max(valid.shape[1], row_tokens)


def batch_layout(valid: np.ndarray, prompt_width: int, multiple: int = 1,
                 row_tokens: int = 0) -> tuple[PackedLayout, float, float]:
    """One batch packed whole (one update of one micro-batch: SFT's): `(layout, padding share padded, packed)`
    from its input mask `valid [N, S]`; rows of `row_length(valid, row_tokens)`, as many as `bucket_rows` of what
    it needs, a multiple of `multiple`."""
    row_len = row_length(valid, row_tokens)
    bins = first_fit_decreasing(valid.sum(axis=1), row_len)
    rows = bucket_rows(len(bins), len(valid), multiple)
    source, predictor = micro_batch_layout(valid, prompt_width, rows, row_len, bins)
    real = float(valid.sum())
    return PackedLayout(source, predictor), 1.0 - real / valid.size, 1.0 - real / (rows * row_len)


class UpdateLayouts(NamedTuple):
    """Every micro-batch layout of one step's updates: source `[U, A * R, S]`, predictor `[U, A * M, T]` (the
    micro-batch `a`'s row `i` at index `i * A + a`, the order `train_step`'s strided split reads), and the share of
    the positions the update computes that are padding, padded layout and packed."""

    layouts: PackedLayout
    padding_frac_padded: float
    padding_frac_packed: float


def update_layouts(valid: np.ndarray, prompt_width: int, rows: np.ndarray, grad_accum: int,
                   multiple: int = 1, row_tokens: int = 0) -> UpdateLayouts:
    """The packed layouts of every micro-batch of a step's updates.

    valid `[N, S]`: the rollout's input mask (`concat(prompt_mask, completion_mask)[:, :-1]`); rows `[U, MB]`: the
    rollout rows of each update's minibatch (`step.minibatch_rows`); micro-batch `a` of update `u` holds rows
    `rows[u, a::grad_accum]`. Rows are `row_length(valid, row_tokens)` long; each micro-batch gets the same
    number of packed rows `R` (`bucket_rows` of the most any needs, a multiple of `multiple`: the data-parallel
    devices the rows are split over), so the update is one program."""
    n_updates, mb = rows.shape
    m = mb // grad_accum
    row_len = row_length(valid, row_tokens)
    micro = [[rows[u, a::grad_accum] for a in range(grad_accum)] for u in range(n_updates)]
    bins = [[first_fit_decreasing(valid[idx].sum(axis=1), row_len) for idx in per] for per in micro]
    r = bucket_rows(max(len(b) for per in bins for b in per), m, multiple)
    s = valid.shape[1]
    t = s - prompt_width + 1
    source = np.zeros((n_updates, grad_accum * r, row_len), np.int32)
    predictor = np.zeros((n_updates, grad_accum * m, t), np.int32)
    for u, per in enumerate(micro):
        for a, idx in enumerate(per):
            src, pred = micro_batch_layout(valid[idx], prompt_width, r, row_len, bins[u][a])
            source[u, a::grad_accum] = src
            predictor[u, a::grad_accum] = pred
    real = float(valid[rows].sum())
    return UpdateLayouts(PackedLayout(source, predictor), 1.0 - real / (rows.size * s),
                         1.0 - real / (n_updates * grad_accum * r * row_len))


def token_budget_micro_batches(lengths: np.ndarray, rows: np.ndarray, budget: int, multiple: int = 1
                               ) -> tuple[np.ndarray, int]:
    """`(rows', A)`: the fewest micro-batches `A` (a divisor of the minibatch size `MB` leaving a multiple of
    `multiple` sequences each) such that the largest minibatch's real tokens over `A` are at most `budget` (the
    most micro-batches when none is), and each minibatch's rows reordered so that the strided split
    (`rows'[u, a::A]`) deals its sequences by length, longest first, in snake order: every micro-batch gets about
    the same number of tokens. `lengths [N]`: each sequence's real tokens; `rows [U, MB]`."""
    n_updates, mb = rows.shape
    most = max(mb // multiple, 1)
    tokens = int(lengths[rows].sum(axis=1).max())
    options = [a for a in range(1, most + 1) if mb % a == 0 and (mb // a) % multiple == 0]
    accum = next((a for a in options if -(-tokens // a) <= budget), options[-1])
    out = np.empty_like(rows)
    for u in range(n_updates):
        order = rows[u][np.argsort(-lengths[rows[u]], kind="stable")]
        members: list[list[int]] = [[] for _ in range(accum)]
        for i, r in enumerate(order):  # snake: 0..A-1, A-1..0, ...
            lap, k = divmod(i, accum)
            members[k if lap % 2 == 0 else accum - 1 - k].append(int(r))
        for a, rs in enumerate(members):
            out[u, a::accum] = rs
    return out, accum


def packed_inputs(tokens: jax.Array, mask: jax.Array, layout: PackedLayout) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed rows' `(tokens, positions, segments)`, each `[R, S]` int32, from the padded inputs `tokens,
    mask [M, S]`: tokens and positions (`positions_from_mask`, restarting per sequence) gathered through
    `layout.source`, segments `m + 1` for sequence `m` and 0 on padding."""
    s = tokens.shape[1]
    src = layout.source
    pad = src < 0
    flat = jnp.where(pad, 0, src)
    gathered_tokens = jnp.where(pad, 0, tokens.reshape(-1)[flat])
    positions = jnp.where(pad, 0, positions_from_mask(mask).reshape(-1)[flat])
    segments = jnp.where(pad, 0, flat // s + 1)
    return gathered_tokens.astype(jnp.int32), positions.astype(jnp.int32), segments.astype(jnp.int32)


def gather_predictors(hidden: jax.Array, layout: PackedLayout) -> jax.Array:
    """The hidden states that predict each completion token, `[M, T, D]`, from the packed rows' `[R, S, D]`."""
    return hidden.reshape(-1, hidden.shape[-1])[layout.predictor]
