"""The larger-number chat task: its problems and the claim-reading reward (hand-written completions)."""

from __future__ import annotations

import pytest

from jaxrl_llm.rewards import resolve_reward
from jaxrl_llm.tasks.larger_number import claimed_larger, larger_number_reward, make_problems


@pytest.mark.parametrize("completion,numbers,claim", [
    ("The answer is 74.", [74, 30], 74),
    ("84 is larger than 61.", [84, 61], 84),
    ("10 is larger than 92.", [10, 92], 10),  # wrong claim, though the last number is the larger one
    ("The larger number is 62.", [47, 62], 62),
    ("47 is smaller than 62", [47, 62], 62),  # "Y is smaller" claims the other number
    ("97.", [29, 97], 97),  # no phrase: the one number mentioned
    ("92 is larger than 10, so the answer is 10", [10, 92], None),  # contradicts itself
    ("Both 84 and 61 are numbers.", [84, 61], None),  # no claim, both mentioned
    ("I cannot tell.", [84, 61], None),
    ("A larger number is 43 and a smaller number is 47", [43, 47], 43),
])
def test_claimed_larger(completion: str, numbers: list[int], claim: int | None) -> None:
    assert claimed_larger(completion, numbers) == claim


def test_reward_scores_the_claim_not_the_last_number() -> None:
    completions = ["10 is larger than 92.", "The answer is 92.", "92", "10 or 92?"]
    fields = dict(numbers=[[10, 92]] * 4, answer=["92"] * 4, completion_lengths=[5] * 4, max_new_tokens=32)
    assert larger_number_reward([""] * 4, completions, **fields) == [0.0, 1.0, 1.0, 0.0]
    # The trainer resolves it by its module path, as the preset names it.
    fn = resolve_reward("jaxrl_llm.tasks.larger_number:larger_number_reward", {})
    assert fn([""] * 4, completions, **fields) == [0.0, 1.0, 1.0, 0.0]


def test_problems_are_distinct_and_correct() -> None:
    problems = make_problems(500, seed=3)
    pairs = {tuple(p["numbers"]) for p in problems}
    assert len(pairs) == 500
    for p in problems:
        a, b = p["numbers"]
        assert a != b and 10 <= min(a, b) and max(a, b) <= 99 and p["answer"] == str(max(a, b))
        assert p["prompt"] == [{"role": "user", "content": f"Which number is larger, {a} or {b}?"}]
    with pytest.raises(ValueError, match="distinct ordered pairs"):
        make_problems(10, seed=0, low=1, high=3)
