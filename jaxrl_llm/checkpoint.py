"""Orbax checkpoints of a run (params, optimizer state, step, RNG key, data position), keep-last-K, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over `ocp.CheckpointManager`: a pytree `state` plus a JSON `meta` dict per step."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=True),
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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
