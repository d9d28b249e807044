"""The code-execution reward `code_tests`: a completion's Python code, followed by its record's unit tests (a
string of asserts), run in the sandbox (jaxrl_llm.envs.sandbox); 1.0 when the program gets through the tests
and exits 0, else 0.0. Where the sandbox cannot run (no bubblewrap, and no opt-in to the plain subprocess), it
raises rather than score every completion 0. A random marker written after the tests tells a pass from code that
exits early with status 0 (`sys.exit(0)`, `os._exit(0)`); code set on cheating could still read it from its own
file.

    rewards:
      - name: jaxrl_llm.rewards.code_execution:code_tests_reward
        kwargs: {tests_field: tests, timeout_s: 5}
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxrl_llm.envs.sandbox import run_python, sandbox_problem

# A fenced block tagged python (or py), or untagged; the last one is the answer (earlier ones are often drafts).
_FENCED = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The last fenced Python block of a completion, else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def code_tests_reward(prompts: Sequence[str], completions: Sequence[str], *, tests_field: str = "tests",
                      timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int = 0,
                      **fields: Any) -> list[float]:
    """1.0 per completion whose code passes its record's tests (field `tests_field`) in the sandbox, else 0.0."""
    tests = fields.get(tests_field)
    if tests is None:
        raise ValueError(f"code_tests needs the records' unit tests in the field {tests_field!r} (a string of "
                         f"Python asserts per record); fields present: {', '.join(sorted(fields)) or 'none'}")
    if len(tests) != len(completions):
        raise ValueError(f"code_tests got {len(tests)} {tests_field!r} values for {len(completions)} completions")
    problem = sandbox_problem()
    if problem:  # no code runs outside the sandbox, and a sandbox that cannot run must not read as failed tests
        raise RuntimeError(problem)

    def score(i: int) -> float:
        marker = secrets.token_hex(16)
        # On stderr, whose end the sandbox keeps, so a long stdout cannot push it out.
        program = (f"{extract_code(completions[i])}\n\n{tests[i] or ''}\n\n"
                   f"__import__('sys').stderr.write({marker!r})\n")
        result = run_python(program, timeout_s=timeout_s, memory_mb=memory_mb)
        passed = result.returncode == 0 and not result.timed_out and result.stderr.endswith(marker)
        return 1.0 if passed else 0.0

    if not completions:
        return []
    # Each sandbox is its own process: threads only wait on them, so more threads than cores is fine.
    workers = max_workers or min(len(completions), 2 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code_tests") as pool:
        return list(pool.map(score, range(len(completions))))


code_tests_reward.__name__ = "code_tests"
