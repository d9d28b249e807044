"""Math-answer rewards: extract a final answer (GSM8K `####`, LaTeX `\\boxed{}`, or the last number) and
compare numerically with the reference; `math_verify_reward` uses the math-verify library for LaTeX."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion or reference: after the last `####`, else the last `\\boxed{}`,
    else the last number in the text; None when there is none."""
    if "####" in text:
        candidate = text.rsplit("####", 1)[1].strip()
        numbers = _NUMBER.findall(candidate)
        return numbers[0] if numbers else (candidate or None)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> float | None:
    if text is None:
        return None
    cleaned = text.replace(",", "").replace("$", "").replace("\\%", "").replace("%", "").strip()
    try:
        return float(cleaned)
    except ValueError:
        numbers = _NUMBER.findall(cleaned)
        return float(numbers[0].replace(",", "")) if len(numbers) == 1 else None


def answers_match(predicted: str | None, reference: str | None, rel_tol: float = 1e-6) -> bool:
    """Numeric equality when both parse as numbers, else exact string equality after stripping."""
    if predicted is None or reference is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
    return predicted.strip() == reference.strip()


def math_answer_reward(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 when the completion's final answer equals the reference answer's, else 0.0."""
    return [
        float(answers_match(extract_answer(c), extract_answer(str(a))))
        for c, a in zip(completions, answer, strict=True)
    ]


def math_verify_reward(
    prompts: Sequence[str], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 when math-verify judges the completion equivalent to the reference (LaTeX-aware), else 0.0."""
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("math_verify reward needs `pip install math-verify` (or the [math] extra)") from e
    scores = []
    for completion, ref in zip(completions, answer, strict=True):
        gold = parse(str(ref) if "$" in str(ref) or "\\" in str(ref) else f"${ref}$")
        scores.append(float(bool(gold) and verify(gold, parse(completion))))
    return scores
