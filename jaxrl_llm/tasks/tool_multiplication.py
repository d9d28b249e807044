"""A task a small model cannot do alone but can do with a calculator: "What is 347 * 812?".

Each record is a chat prompt (one user message), the two factors and the exact product. Without a tool,
SmolLM2-135M-Instruct multiplies three-digit numbers wrong almost always; with the calculator (`env.name:
tool_use`, `env.tools: [calculator]`) it needs to write one well-formed call and copy its result.

`python -m jaxrl_llm data tool_multiplication --out data/tool_multiplication` writes `train.jsonl` / `test.jsonl`
(disjoint pairs, fixed seed) and `sft.jsonl`, demonstrations for the SFT warm start made here from the training
pairs: for one pair, the call (the prompt with the tools' system message -> the tool call) and, for another, the
answer (the conversation through the tool's result -> "The answer is N."). Both are chat-format prompts rendered
with the same system message a multi-turn run adds, so SFT and RL see the same conversation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.envs.tools import CALCULATOR, tool_instructions
from jaxrl_llm.tasks.dataset_files import write_jsonl


def make_problems(count: int, seed: int, low: int = 100, high: int = 999) -> list[dict[str, Any]]:
    """`count` distinct problems `{"prompt": [user message], "answer": "281764", "factors": [347, 812]}`."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[dict[str, Any]] = []
    while len(problems) < count:
        a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
        if (a, b) in seen:
            continue
        seen.add((a, b))
        problems.append({"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b),
                         "factors": [a, b]})
    return problems


def tool_call_text(a: int, b: int) -> str:
    """The assistant turn that asks the calculator for `a * b`."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}) + \
        "</tool_call>"


def demonstrations(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SFT examples `{"prompt": messages, "answer": text}`: even problems teach the call, odd ones the answer
    after the tool's result (so no problem's whole solution is shown)."""
    system = {"role": "system", "content": tool_instructions([CALCULATOR])}
    out = []
    for i, p in enumerate(problems):
        a, b = p["factors"]
        opening = [system, *p["prompt"]]
        if i % 2 == 0:
            out.append({"prompt": opening, "answer": tool_call_text(a, b)})
        else:
            conversation = [*opening, {"role": "assistant", "content": tool_call_text(a, b)},
                            {"role": "tool", "content": str(a * b)}]
            out.append({"prompt": conversation, "answer": f"The answer is {a * b}."})
    return out


def write_dataset(out: Path, train: int, test: int, seed: int, sft: int = 256) -> str:
    """`train.jsonl`, `test.jsonl` and `sft.jsonl` (demonstrations from the first training pairs) in `out`; what it
    wrote, in words."""
    problems = make_problems(train + test, seed)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", problems[:train])
    write_jsonl(out / "test.jsonl", problems[train:])
    write_jsonl(out / "sft.jsonl", demonstrations(problems[:min(sft, train)]))
    return f"wrote {out}/train.jsonl ({train}), test.jsonl ({test}), sft.jsonl ({min(sft, train)})"
