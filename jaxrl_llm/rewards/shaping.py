"""Format and length rewards."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def format_reward(
    prompts: Sequence[str], completions: Sequence[str], *, pattern: str = r"(?s).*####\s*-?[\d,.]+\s*", **_: Any
) -> list[float]:
    """1.0 when the whole completion matches the regular expression `pattern` (re.fullmatch), else 0.0.
    For tags, e.g. `pattern="(?s)<think>.*</think>\\s*<answer>.*</answer>"`."""
    regex = re.compile(pattern)
    return [float(regex.fullmatch(c.strip()) is not None) for c in completions]


def overlong_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    completion_lengths: Sequence[int],
    max_new_tokens: int,
    buffer_tokens: int = 4,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), measured in tokens, not characters:

        r(L) = 0                              if L <= L_max - L_buffer
               (L_max - L_buffer - L) / L_buffer  if L_max - L_buffer < L <= L_max
               -1                             if L > L_max

    with `L` the completion length in tokens and `L_max = max_new_tokens`. A truncated completion has
    `L = max_new_tokens` (the sampler cannot emit more), so it gets the largest penalty of the buffer.
    """
    threshold = max_new_tokens - buffer_tokens
    out = []
    for length in completion_lengths:
        if length <= threshold:
            out.append(0.0)
        elif length <= max_new_tokens:
            out.append((threshold - length) / buffer_tokens)
        else:
            out.append(-1.0)
    return out
