"""Orbax checkpoints of a run (params, optimizer state, step, RNG key, data position), keep-last-K, resume.

`keep_only_weights` reduces a finished run's checkpoints to one holding the policy weights (the entries of
`WEIGHT_KEYS`) and the position: what `final_checkpoint: weights` keeps. A resume from it restores those and
starts the rest of the state (optimizer moments) from the algorithm's fresh initial state, with a notice.

A checkpoint that cannot be read (a truncated file, a half-written step left by a crash) is moved aside to
`corrupt_checkpoints/` next to the checkpoint directory, with a warning, and the previous one is used.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxrl_llm.errors import RunDirError, one_line

WEIGHT_KEYS = ("params", "key")  # what a weights-only checkpoint keeps of the state


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager`: a pytree `state` plus a JSON `meta` dict per step."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        self.keep = max(keep, 1)
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True)
        )

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore into the structure, shapes, dtypes and shardings of `abstract_state`."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return restored.state, restored.meta

    def keep_only_weights(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Replace every checkpoint by one of `step` holding only `WEIGHT_KEYS` of `state`."""
        self.manager.wait_until_finished()
        for old in self.all_steps():
            self.manager.delete(old)
        self.save(step, {k: state[k] for k in WEIGHT_KEYS}, {**meta, "weights_only": True})
        self.manager.wait_until_finished()

    def _weights_only(self, step: int) -> bool:
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception:  # unreadable: the full restore below reports it
            return False
        return bool(meta and meta.get("weights_only"))

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
                if self._weights_only(step):
                    weights, meta = self.restore(step, {k: abstract_state[k] for k in WEIGHT_KEYS})
                    print(f"jaxrl_llm: the checkpoint of step {step} holds only the policy weights "
                          f"(final_checkpoint=weights): the optimizer state starts afresh", file=sys.stderr)
                    restored = ({**like, **weights}, meta)
                else:
                    restored = self.restore(step, abstract_state)
            except Exception as e:  # any failure to read this step: try the one before
                aside = self.directory.parent / "corrupt_checkpoints" / str(step)
                print(f"jaxrl_llm: warning: checkpoint {self.directory / str(step)} cannot be read "
                      f"({type(e).__name__}: {one_line(str(e))[:200]}); moved to {aside}, "
                      f"falling back to the previous one", file=sys.stderr)
                aside.parent.mkdir(parents=True, exist_ok=True)
                if aside.exists():
                    shutil.rmtree(aside)
                shutil.move(str(self.directory / str(step)), aside)
                self.manager.close()
                self.manager = self._manager()
                continue
            print(f"jaxrl_llm: resumed from the checkpoint of step {step} in {self.directory}", file=sys.stderr)
            return restored
        raise RunDirError(f"--resume: none of the checkpoints in {self.directory} ({steps}) can be read; they "
                          f"were moved to {self.directory.parent / 'corrupt_checkpoints'}")

    def set_aside(self, first_step: int, folder: str) -> list[int]:
        """Move the checkpoints of steps >= `first_step` to `folder` next to the checkpoint directory (so a
        resume starts before them, and nothing is deleted); returns their steps."""
        self.manager.wait_until_finished()
        moved = [s for s in self.all_steps() if s >= first_step]
        for step in moved:
            target = self.directory.parent / folder / str(step)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(self.directory / str(step)), target)
        if moved:
            self.manager.close()
            self.manager = self._manager()
        return moved

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree: Any) -> Any:
    """Shapes, dtypes and shardings of `tree`'s arrays: what `restore` fills."""
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)
