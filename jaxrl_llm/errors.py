"""The project's errors: each kind knows its exit code, so every command reports it as one line.

    UsageError (exit 2): the input is wrong and the user must change it — config, data, model directory,
                         out_dir, command line.
    RunError   (exit 1): the input was accepted but the run failed — a reward function, training itself.

Messages say what is wrong, where (file:line, or the config key and whether it came from the YAML or the
command line) and what to do; they are single lines (`one_line`).
"""

from __future__ import annotations


class JaxrlError(Exception):
    """Base of every error the commands report as one line; `exit_code` is the process's exit status."""

    exit_code = 1


class UsageError(JaxrlError):
    """An input the user must change (exit 2)."""

    exit_code = 2


class ConfigError(UsageError, ValueError):
    """A configuration that cannot run; the message names the field(s) at fault."""


class DataError(UsageError, ValueError):
    """Malformed data: the message names the file and line (or the dataset and record)."""


class ModelError(UsageError, ValueError):
    """A model directory or file that cannot be loaded (truncated or corrupt safetensors, a missing shard, a
    malformed config.json or index, weights that disagree with config.json): names the file."""


class ConversionError(ModelError):
    """A model directory or checkpoint that cannot be loaded or converted: names the file or tensor at fault."""


class RunDirError(UsageError):
    """The out_dir cannot be used as asked: another run's outputs, a lock, or nothing to resume."""


class StorageError(UsageError):
    """A write the file system refused (disk full, read-only, quota): names the path and the cause (exit 2);
    what was written before it (the previous checkpoint) is intact."""


class RunError(JaxrlError, RuntimeError):
    """The run started but cannot go on (exit 1); checkpoints already written are kept."""


class RewardError(RunError):
    """A reward function failed, hung or returned something unusable; the message names it."""


class RewardNameError(ConfigError, RewardError):
    """A reward function named in the config that does not exist or does not import (a config error, exit 2)."""


class TrainingError(RunError):
    """Training cannot continue (non-finite updates for too long, a diverged policy)."""


class DivergenceError(TrainingError):
    """The policy collapsed (see `jaxrl_llm.run.divergence`); the last good checkpoint is kept."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the run after a step; its checkpoint is saved (exit 130, no traceback).

    A `KeyboardInterrupt`, so Python code that catches interrupts (a notebook) sees it as one."""

    exit_code = 130

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def one_line(text: str) -> str:
    """`text` with its lines joined, so a message is always a single line on stderr."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())
