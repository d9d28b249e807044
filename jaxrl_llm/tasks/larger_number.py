"""A chat task with verifiable answers for real instruct models: "Which number is larger, 47 or 62?".

Each record is a chat prompt (one user message; the model's own chat template adds its system prompt), the
two numbers and the answer, the larger of two different two-digit numbers. The reward is
`larger_number_reward`, which reads what the completion *claims* (see there). A last-number check
(`math_answer`) is not enough here: GRPO with it learned to write "10 is larger than 92." (last number 92,
scored correct, claim wrong) within 20 steps.

`python -m jaxrl_llm data larger_number --out data/larger_number` writes `train.jsonl` / `test.jsonl`
(disjoint ordered pairs, fixed seed) and `preferences_train.jsonl` / `preferences_test.jsonl` (the same prompts
as chat-format preference pairs for DPO: the true claim chosen over the reversed one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.tasks.dataset_files import write_jsonl


def make_problems(count: int, seed: int, low: int = 10, high: int = 99) -> list[dict[str, object]]:
    """`count` distinct problems `{"prompt": [{"role": "user", "content": ...}], "answer": "62"}` over ordered
    pairs of different integers in `[low, high]`."""
    pairs = (high - low + 1) * (high - low)
    if count > pairs:
        raise ValueError(f"only {pairs} distinct ordered pairs in [{low}, {high}], asked for {count}")
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[dict[str, object]] = []
    while len(problems) < count:
        a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
        if a == b or (a, b) in seen:
            continue
        seen.add((a, b))
        question = f"Which number is larger, {a} or {b}?"
        problems.append({"prompt": [{"role": "user", "content": question}], "answer": str(max(a, b)),
                         "numbers": [a, b]})
    return problems


_NUMBER = r"(-?\d+)"
# "62 is larger", "62 is the larger (one|number)", "62 is greater/bigger"
_SUBJECT_CLAIM = re.compile(_NUMBER + r"\s+is\s+(?:a\s+|the\s+)?(?:larger|greater|bigger)\b", re.IGNORECASE)
# "the answer is 62", "the larger (number) is 62", "larger one is 62"
_OBJECT_CLAIM = re.compile(r"(?:answer|larger|greater|bigger)(?:\s+(?:number|one|value))?\s+is\s*:?\s*" + _NUMBER,
                           re.IGNORECASE)
_SMALLER_CLAIM = re.compile(_NUMBER + r"\s+is\s+(?:a\s+|the\s+)?(?:smaller|less|lower)\b", re.IGNORECASE)


def claimed_larger(completion: str, numbers: Sequence[int]) -> int | None:
    """The number the completion says is the larger one, or None when it says none or contradicts itself.

    Claims: "X is (the) larger/greater/bigger", "the answer/larger (number) is X", and "Y is smaller/less"
    (which claims the other number). Every claim must name the same number. With no such phrase, a completion
    that mentions exactly one of the two numbers claims that one ("97." or "It is 97").
    """
    a, b = (int(n) for n in numbers)
    claims = [int(m) for m in _SUBJECT_CLAIM.findall(completion)] + [int(m) for m in _OBJECT_CLAIM.findall(completion)]
    claims += [b if int(m) == a else a if int(m) == b else int(m) for m in _SMALLER_CLAIM.findall(completion)]
    if claims:
        return claims[0] if len(set(claims)) == 1 else None
    mentioned = {int(n) for n in re.findall(_NUMBER, completion)} & {a, b}
    return mentioned.pop() if len(mentioned) == 1 else None


def larger_number_reward(prompts: Sequence[str], completions: Sequence[str], *, numbers: Sequence[Sequence[int]],
                         answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion's claim (`claimed_larger`) is the larger number, else 0.0; called on a batch."""
    return [float(claimed_larger(c, n) == int(a)) for c, n, a in zip(completions, numbers, answer, strict=True)]


def make_preferences(problems: Sequence[dict[str, Any]]) -> list[dict[str, object]]:
    """Chat-format preference pairs (TRL's conversational format) for DPO: the same prompt, the true claim
    "The number 62 is larger than the number 47." chosen over the reversed one."""
    out = []
    for p in problems:
        big, small = sorted(p["numbers"], reverse=True)  # type: ignore[call-overload]
        say = "The number {} is larger than the number {}."
        out.append({"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": say.format(big, small)}],
                    "rejected": [{"role": "assistant", "content": say.format(small, big)}]})
    return out


def write_dataset(out: Path, train: int, test: int, seed: int) -> None:
    """`train.jsonl` / `test.jsonl` and their preference pairs in `out`."""
    problems = make_problems(train + test, seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", problems[:train]), ("test", problems[train:])):
        write_jsonl(out / f"{name}.jsonl", rows)
        write_jsonl(out / f"preferences_{name}.jsonl", make_preferences(rows))
