"""Rows of different lengths as one rectangular batch: prompts right-aligned (left padding, what the samplers and
the trainers' prompts take) and completions left-aligned (right padding, the samplers' output and every trainer's
targets). Host-side numpy, before anything goes to a device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def left_pad(sequences: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens, mask [B, length]` int32 with each sequence right-aligned (left padding); a sequence longer than
    `length` is a `ValueError`."""
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence of {len(seq)} tokens does not fit length {length}")
        if len(seq):
            tokens[i, length - len(seq) :] = seq
            mask[i, length - len(seq) :] = 1
    return tokens, mask


def right_pad(rows: Sequence[Sequence[float] | np.ndarray], length: int, fill: float = 0,
              dtype: np.dtype | type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    """`values [B, length]` (`dtype`, `fill` after each row) and `mask [B, length]` int32 (1 on each row's values)
    with each row left-aligned (right padding); a row longer than `length` is a `ValueError`."""
    values = np.full((len(rows), length), fill, dtype)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"row of {len(row)} values does not fit length {length}")
        values[i, : len(row)], mask[i, : len(row)] = row, 1
    return values, mask
