"""`python -m jaxrl_llm <command> [options]`: the package's commands behind one entry point (also installed as
the `jaxrl-llm` console script). Training is `python train.py` (or `jaxrl_llm.train(...)` from Python).

    eval      greedy held-out evaluation of a policy: a run, a checkpoint or a model directory
    compare   blind side-by-side comparison of two policies' answers
    report    a run's (or several runs') HTML report
    export    a run's checkpoint as a Hugging Face model directory
    generate  completions from a policy for prompts given on the command line or in a file
    plan      per-device memory of a model, mesh and batch, before anything is allocated
    kernels   build the C++ CPU kernels ahead of a run and say which this machine runs, or why not
    data      write one of the project's task datasets (arithmetic, larger_number, tool_multiplication)

`python -m jaxrl_llm <command> --help` shows a command's options; each command's code is
`jaxrl_llm/cli/<command>.py`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from jaxrl_llm.cli.errors import run_command

COMMANDS = ("eval", "compare", "report", "export", "generate", "plan", "kernels", "data")
PROG = "python -m jaxrl_llm"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `argv[0]`'s command with the rest of `argv`; its exit code (2 for an unknown or missing command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: unknown command {command!r}; expected one of {', '.join(COMMANDS)} "
              f"(training: python train.py)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"jaxrl_llm.cli.{command}")
    return run_command(f"{PROG} {command}", module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
