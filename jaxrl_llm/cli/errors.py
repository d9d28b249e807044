"""The commands' error boundary: every failure becomes one line on stderr and an exit code.

`run_command(prog, main, argv)` calls `main(argv)` and turns what it raises into `prog: error: ...`:
project errors (`jaxrl_llm.errors`) with their own exit code (2 for usage, config, data, model and storage;
1 for runtime), file-system errors (exit 2: disk full, read-only, a missing path), anything else as an internal
error (exit 1). With `--debug` in `argv` the exception propagates with its traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from jaxrl_llm.errors import JaxrlError, RunInterrupted, UsageError, one_line

DEBUG_FLAG = "--debug"


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are `UsageError`s (one line, exit 2), and which knows `--debug`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.add_argument(DEBUG_FLAG, action="store_true", help="show the traceback of an error")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def error_line(prog: str, error: BaseException) -> tuple[str, int]:
    """`(message, exit code)` for an exception raised by a command."""
    if isinstance(error, JaxrlError):
        return f"{prog}: error: {one_line(str(error))}", error.exit_code
    if isinstance(error, OSError):  # the disk refused a read or write: the user must make room or fix a path
        reason = one_line(error.strerror or str(error))
        reason = reason[:1].lower() + reason[1:]
        where = f" at {error.filename}" if getattr(error, "filename", None) else ""
        return f"{prog}: error: file system: {reason}{where}", 2
    return (f"{prog}: error: internal error {type(error).__name__}: {one_line(str(error))} "
            f"(rerun with {DEBUG_FLAG} for the traceback, and please report it)"), 1


def run_command(prog: str, main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run `main(argv)` (without `--debug`) and return its exit code; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    if debug:
        argv.remove(DEBUG_FLAG)
        return main(argv)
    try:
        return main(argv)
    except RunInterrupted as e:  # the run saved a checkpoint and says how to resume
        print(f"{prog}: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; checkpoints written so far are kept (resume with --resume)", file=sys.stderr)
        return 130
    except Exception as e:  # the boundary: nothing below prints a traceback unless --debug
        message, code = error_line(prog, e)
        print(message, file=sys.stderr)
        return code
