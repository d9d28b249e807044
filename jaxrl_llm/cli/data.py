"""`python -m jaxrl_llm data TASK [--out DIR] [--train N] [--test N] [--seed S] [task options]`: write one of the
project's task datasets (`jaxrl_llm/tasks/`) as JSONL:

    arithmetic           train/test problems of the default job (and addition's preference pairs); --max-digits,
                         --ops, --sloppy (the share of SFT answers that forget a carry)
    larger_number        "which number is larger" and its preference pairs
    tool_multiplication  three-digit products for the calculator tool, and SFT demonstrations (--sft N)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxrl_llm.cli.errors import CommandParser, UsageError
from jaxrl_llm.tasks import arithmetic, larger_number, tool_multiplication

# task -> (default folder, train, test, seed)
DEFAULTS = {"arithmetic": ("data/arithmetic", 20000, 1000, 1234),
            "larger_number": ("data/larger_number", 6000, 500, 2024),
            "tool_multiplication": ("data/tool_multiplication", 2000, 200, 11)}


def task_parser(task: str) -> CommandParser:
    """The command line of `task`: `--out`, `--train`, `--test`, `--seed` and the task's own options."""
    out, train, test, seed = DEFAULTS[task]
    parser = CommandParser(prog=f"python -m jaxrl_llm data {task}", description=f"Write the {task} task's JSONL files.")
    parser.add_argument("--out", default=out)
    parser.add_argument("--train", type=int, default=train)
    parser.add_argument("--test", type=int, default=test)
    parser.add_argument("--seed", type=int, default=seed)
    if task == "arithmetic":
        parser.add_argument("--max-digits", type=int, default=3)
        parser.add_argument("--ops", default="+")
        parser.add_argument("--sloppy", type=float, default=0.6, help="share of sft_answer that forget carries")
    if task == "tool_multiplication":
        parser.add_argument("--sft", type=int, default=256, help="SFT demonstrations (from the first training pairs)")
    return parser


WRITERS: dict[str, Callable[[argparse.Namespace], str | None]] = {
    "arithmetic": lambda a: arithmetic.write_dataset(Path(a.out), a.train, a.test, a.seed, a.max_digits, a.ops,
                                                     a.sloppy),
    "larger_number": lambda a: larger_number.write_dataset(Path(a.out), a.train, a.test, a.seed),
    "tool_multiplication": lambda a: tool_multiplication.write_dataset(Path(a.out), a.train, a.test, a.seed, a.sft),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv or [])
    if not argv or argv[0] not in DEFAULTS:
        given = f"unknown task {argv[0]!r}" if argv and not argv[0].startswith("-") else "no task given"
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        raise UsageError(f"{given}; expected one of {', '.join(DEFAULTS)} (see python -m jaxrl_llm data --help)")
    parser = task_parser(argv[0])
    args = parser.parse_args(argv[1:])
    if args.train < 1 or args.test < 0:
        parser.error(f"--train {args.train} must be >= 1 and --test {args.test} >= 0")
    said = WRITERS[argv[0]](args)
    if said:
        print(said)
    return 0
