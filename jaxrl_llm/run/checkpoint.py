"""Orbax checkpoints of a run (params, optimizer state, step, RNG key, data position), keep-last-K, resume.

`keep_only_weights` reduces a finished run's checkpoints to one holding the policy weights (the entries of
`WEIGHT_KEYS`) and the position: what `final_checkpoint: weights` keeps. A resume from it restores those and
starts the rest of the state (optimizer moments) from the algorithm's fresh initial state, with a notice.

A checkpoint that cannot be read (a truncated file, a half-written step left by a crash) is moved aside to
`corrupt_checkpoints/` next to the checkpoint directory, with a warning, and the previous one is used.

A checkpoint that cannot be written (disk full, a read-only or vanished directory) raises `StorageError`, one
line naming the step, the directory and the cause; orbax's writer threads log nothing meanwhile, the half-written
step is removed and the previous checkpoint stays as it was.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl_llm.errors import RunDirError, StorageError, one_line

WEIGHT_KEYS = ("params", "key")  # what a weights-only checkpoint keeps of the state


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager`: a pytree `state` plus a JSON `meta` dict per step."""

    def __init__(self, directory: str | Path, keep: int = 2,
                 claim: Callable[[Path], None] | None = None) -> None:
        """`claim(path)` is told of each folder the checkpointer is about to create (the run's manifest)."""
        self.directory = Path(directory).absolute()
        self.keep = max(keep, 1)
        self.claim = claim or (lambda path: None)
        self.claim(self.directory)
        self.pending: int | None = None  # the step whose (asynchronous) write may still be in flight
        self.failed = False
        with quiet_orbax():
            self.manager = open_manager(self.directory, self.keep)

    def _reopen(self) -> None:
        """A fresh manager after step folders were moved behind the current one's back."""
        self.manager.close()
        self.manager = open_manager(self.directory, self.keep)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start writing the checkpoint of `step` (asynchronously); a failed earlier write raises here."""
        with self._writing():
            self.manager.wait_until_finished()
            self.pending = step
            args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
            self.manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Block until the last checkpoint is on disk; `StorageError` if it could not be written."""
        with self._writing():
            self.manager.wait_until_finished()
        self.pending = None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            with quiet_orbax():
                yield
        except Exception as e:
            cause = storage_cause(e)
            if cause is None:
                raise
            self.failed = True
            step, self.pending = self.pending, None
            if step is not None:
                remove_partial_write(self.directory, step)
                with contextlib.suppress(Exception):
                    self.manager.reload()
            raise write_failure(cause, step, self.directory, self.latest_step()) from None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore into the structure, shapes, dtypes and shardings of `abstract_state`."""
        return read_checkpoint(self.manager, step, abstract_state)

    def keep_only_weights(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Replace every checkpoint by one of `step` holding only `WEIGHT_KEYS` of `state`."""
        self.wait()
        for old in self.all_steps():
            self.manager.delete(old)
        self.save(step, {k: state[k] for k in WEIGHT_KEYS}, {**meta, "weights_only": True})
        self.wait()

    def _weights_only(self, step: int) -> bool:
        return holds_only_weights(self.manager, step)

    def restore_latest(self, like: Any) -> tuple[Any, dict[str, Any]]:
        """The newest checkpoint that reads back whole, into the shapes, dtypes and shardings of the pytree
        `like`; unreadable ones are moved aside with a warning. Raises `RunDirError` without a readable one.
        A weights-only checkpoint fills the rest of the state from `like`."""
        abstract_state = abstract_like(like)
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise RunDirError(f"--resume: no finished checkpoint in {self.directory} (a run stopped before its first "
                              f"checkpoint was written leaves none); start over with --overwrite instead of --resume")
        for step in steps:
            try:
                restored = read_resumable(self.manager, step, like, abstract_state)
            except Exception as e:  # any failure to read this step: try the one before
                move_unreadable_aside(self.directory, step, e, self.claim)
                self._reopen()
                continue
            print(f"jaxrl_llm: resumed from the checkpoint of step {step} in {self.directory}", file=sys.stderr)
            return restored
        raise RunDirError(f"--resume: none of the checkpoints in {self.directory} ({steps}) can be read; they "
                          f"were moved to {self.directory.parent / 'corrupt_checkpoints'}")

    def set_aside(self, first_step: int, folder: str) -> list[int]:
        """Move the checkpoints of steps >= `first_step` to `folder` next to the checkpoint directory (so a
        resume starts before them, and nothing is deleted); returns their steps."""
        self.wait()
        moved = [s for s in self.all_steps() if s >= first_step]
        for step in moved:
            move_folder(self.directory / str(step), self.directory.parent / folder / str(step), self.claim)
        if moved:
            self._reopen()
        return moved

    def close(self) -> None:
        """Finish the last write and close; after a failed write (already reported) only close."""
        try:
            if not self.failed:
                self.wait()
        finally:
            with quiet_orbax(), contextlib.suppress(Exception):
                self.manager.close()


def open_manager(directory: Path, keep: int) -> ocp.CheckpointManager:
    """An orbax manager of `directory` (created if missing) that keeps the newest `keep` steps."""
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def holds_only_weights(manager: ocp.CheckpointManager, step: int) -> bool:
    """Whether the checkpoint of `step` is a weights-only one (`keep_only_weights`), from its meta alone."""
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception:  # unreadable: the full restore reports it
        return False
    return bool(meta and meta.get("weights_only"))


def read_checkpoint(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """`(state, meta)` of `step`, into the structure, shapes, dtypes and shardings of `abstract_state`."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
    restored = manager.restore(step, args=args)
    return restored.state, restored.meta


def read_resumable(manager: ocp.CheckpointManager, step: int, like: Any,
                   abstract_state: Any) -> tuple[Any, dict[str, Any]]:
    """`read_checkpoint`, except that a weights-only checkpoint fills the rest of the state from `like`."""
    if not holds_only_weights(manager, step):
        return read_checkpoint(manager, step, abstract_state)
    weights, meta = read_checkpoint(manager, step, {k: abstract_state[k] for k in WEIGHT_KEYS})
    print(f"jaxrl_llm: the checkpoint of step {step} holds only the policy weights "
          f"(final_checkpoint=weights): the optimizer state starts afresh", file=sys.stderr)
    return {**like, **weights}, meta


def move_unreadable_aside(directory: Path, step: int, error: Exception, claim: Callable[[Path], None]) -> None:
    """Move the checkpoint of `step` that `error` says cannot be read to `corrupt_checkpoints/` next to
    `directory`, with a warning (the resume falls back to the step before)."""
    aside = directory.parent / "corrupt_checkpoints" / str(step)
    print(f"jaxrl_llm: warning: checkpoint {directory / str(step)} cannot be read "
          f"({type(error).__name__}: {one_line(str(error))[:200]}); moved to {aside}, "
          f"falling back to the previous one", file=sys.stderr)
    move_folder(directory / str(step), aside, claim)


def move_folder(source: Path, target: Path, claim: Callable[[Path], None]) -> None:
    """Move `source` to `target`, replacing what was there; `claim` is told of `target`'s parent first."""
    claim(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(source), target)


def remove_partial_write(directory: Path, step: int) -> None:
    """The unfinished folder a failed write of `step` left (ours, and it holds the space the disk lacks)."""
    for partial in directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(partial, ignore_errors=True)


def write_failure(cause: str, step: int | None, directory: Path, kept: int | None) -> StorageError:
    """The one-line error of a failed write of `step`, saying whether the checkpoint of `kept` survives."""
    return StorageError(
        f"{cause} while writing checkpoint {step} to {directory}; "
        + (f"the checkpoint of step {kept} is intact (continue with --resume once there is room)"
           if kept is not None else "no earlier checkpoint was written")
    )


# orbax reports a failed write from each of its writer threads with a logged traceback, whenever the thread
# notices it, before the main thread sees the exception; the one-line `StorageError` replaces them. Only
# records of storage failures are dropped: orbax's other messages still reach the log.
_ORBAX_LOGGERS = ("absl", "orbax", "asyncio")


class _StorageFailureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ((error is not None and storage_cause(error)) or _text_cause(record.getMessage()))


_FILTER = _StorageFailureFilter()


def _drop_closed_loop_callbacks(previous: Any) -> Any:
    """An unraisable-exception hook for what a failed write leaves behind: tensorstore completes the writes
    orbax cancelled on a loop that is gone, and each completion reports 'Event loop is closed'."""
    def hook(unraisable: Any) -> None:
        if not (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    return hook


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Install the filters (they stay: orbax's threads report after the call that started them returned)."""
    for name in _ORBAX_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if not getattr(sys.unraisablehook, "drops_closed_loop_callbacks", False):
        sys.unraisablehook = _drop_closed_loop_callbacks(sys.unraisablehook)
    yield


_STORAGE_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.ENOENT: "the directory disappeared", errno.EIO: "input/output error"}
# tensorstore reports an OS error as a status string, not an errno
_STORAGE_TEXTS = (("No space left on device", "no space left on device"),
                  ("Disk quota exceeded", "disk quota exceeded"), ("Read-only file system", "read-only file system"),
                  ("Permission denied", "permission denied"), ("RESOURCE_EXHAUSTED", "no space left on device"))


def storage_cause(error: BaseException) -> str | None:
    """'no space left on device' (or another storage cause) when `error` or its cause is a failed write."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return _STORAGE_ERRNOS[e.errno]
        cause = _text_cause(str(e))
        if cause is not None:
            return cause
        e = e.__cause__ or e.__context__
    return None


def _text_cause(text: str) -> str | None:
    return next((cause for needle, cause in _STORAGE_TEXTS if needle in text), None)


def abstract_like(tree: Any) -> Any:
    """Shapes, dtypes and shardings of `tree`'s arrays: what `restore` fills."""

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)
