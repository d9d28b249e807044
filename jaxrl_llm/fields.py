"""A config field's allowed values, kept in its dataclass metadata: `at_least`, `positive`, `fraction`, `within`,
`finite` (a numeric `Range`) and `one_of` (choices). `config.schema.check_fields` reads them, on the config's own
sections and on the RL math's options (`rl.options`) alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

INF = float("inf")


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values: finite, and between `low` and `high` (each closed unless `*_open`)."""

    low: float = -INF
    high: float = INF
    low_open: bool = False
    high_open: bool = False

    def error(self, key: str, value: float) -> str | None:
        """The one-line complaint about `key=value`, or None when it is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key}={value} must be a finite number"
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        if not (too_low or too_high) or self.low == -INF and self.high == INF:
            return None
        low = "" if self.low == -INF else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high == INF else f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{key}={value} must be {' and '.join(b for b in (low, high) if b)}"


def _ranged(default: Any, bounds: Range) -> Any:
    return field(default=default, metadata={"range": bounds})


def at_least(default: float, low: float = 0.0) -> Any:
    return _ranged(default, Range(low))


def positive(default: float) -> Any:
    return _ranged(default, Range(0.0, low_open=True))


def fraction(default: float) -> Any:
    return _ranged(default, Range(0.0, 1.0))


def within(default: float, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Any:
    return _ranged(default, Range(low, high, low_open, high_open))


def finite(default: float) -> Any:
    return _ranged(default, Range())


def one_of(default: str, choices: tuple[str, ...]) -> Any:
    return field(default=default, metadata={"choices": choices})
