"""A reward for the multi-process test: 1.0 when a completion starts with a digit; each call appends
`process_index rows` to the file named by $REWARD_LOG, so the test sees which process scored how many rows."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def starts_with_digit(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    import jax

    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(f"{jax.process_index()} {len(completions)}\n")
    return [float(c[:1].isdigit()) for c in completions]
