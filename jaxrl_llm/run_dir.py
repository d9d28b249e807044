"""A run's output directory: one run at a time, nothing overwritten unasked, every start's config kept.

    open_run_dir(config, resume=..., overwrite=..., allow_config_change=...) -> RunDirectory

- A lock file (`out_dir/.lock`: PID, host, start time) marks the directory as in use; a second run into it
  stops with a message. A lock whose process is gone (same host) is stale and taken over with a notice.
- A fresh start refuses a directory that holds another run's outputs (checkpoints, metrics, export) unless
  `overwrite` is given, which removes those outputs first.
- A resume needs a checkpoint, and compares the new config with the one the checkpointed run started with:
  changes to the math or shapes refuse unless `allow_config_change`; cadence changes proceed with a notice.
- Each start's config is written to `configs/NNN-start.yaml` / `NNN-resume.yaml`; the first one is also
  `config.yaml`. Nothing is overwritten.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from jaxrl_llm.config import RunConfig, to_dict, to_yaml
from jaxrl_llm.errors import RunDirError

LOCK_NAME = ".lock"
# What a run writes into its out_dir; any of these present means the directory holds a run (its config files
# alone do not: a start that failed before its first step leaves only those).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard", "hf", "tokenizer",
               "corrupt_checkpoints", "diverged_checkpoints", "summary.json", "report", "eval", "wandb")
CONFIG_FILES = ("config.yaml", "configs")
# Config keys a resume may change freely: cadence, memory knobs and reporting; the math stays the same.
SAFE_TO_CHANGE = ("out_dir", "steps", "log_every", "sample_every", "eval_every", "eval_size", "eval_batch_size",
                  "checkpoint_every", "keep_checkpoints", "export", "export_dir", "tensorboard", "progress_bar",
                  "on_divergence", "divergence.", "distributed.", "mesh.", "model.remat", "model.logprob_block_mib",
                  "model.attention_query_chunk", "sft.eval_batch_size", "data.eval", "data.eval_split",
                  "eval_reward", "final_checkpoint", "diagnostics.", "logging.", "report")


def _notice(text: str) -> None:
    print(f"jaxrl_llm: {text}", file=sys.stderr)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:  # a killed child its parent has not reaped yet is a zombie: gone for our purpose
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            if isinstance(v, dict) and v and k != "init" and k != "kwargs":
                out.update(_flatten(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    return {prefix.rstrip("."): tree}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(key, old value, new value)` for each dotted key whose value differs."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def unsafe_changes(changes: list[tuple[str, Any, Any]], new: RunConfig) -> list[tuple[str, Any, Any]]:
    """The changes that alter the math or the shapes of a resumed run (see `SAFE_TO_CHANGE`)."""
    def safe(key: str) -> bool:
        if key == "steps":  # the decay of a cosine / linear schedule spans all steps
            return new.optim.schedule == "constant"
        return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)

    return [c for c in changes if not safe(c[0])]


def _describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)


@dataclasses.dataclass
class RunDirectory:
    """An out_dir held by this process; `release()` removes the lock (also at interpreter exit)."""

    path: Path
    lock_file: Path | None

    def release(self) -> None:
        if self.lock_file is None:
            return
        try:
            if json.loads(self.lock_file.read_text()).get("pid") == os.getpid():
                self.lock_file.unlink()
        except (OSError, ValueError):
            pass
        self.lock_file = None


def _acquire_lock(out_dir: Path) -> Path:
    lock = out_dir / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            pid, host = holder.get("pid"), holder.get("host")
            if pid == os.getpid() and host == me["host"]:
                return lock  # this process already holds it (a trainer built twice in one program)
            if isinstance(pid, int) and host == me["host"] and _pid_alive(pid):
                raise RunDirError(
                    f"{out_dir} is in use by another run (PID {pid} on {host}, started {holder.get('started')}); "
                    f"wait for it to finish or choose another out_dir"
                ) from None
            if isinstance(pid, int) and host != me["host"]:
                raise RunDirError(
                    f"{out_dir} is locked by PID {pid} on host {host} (started {holder.get('started')}); if that "
                    f"run is gone, delete {lock}, else choose another out_dir"
                ) from None
            _notice(f"taking over the stale lock {lock} (PID {pid} on {host} is gone)")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return lock
    raise RunDirError(f"could not take the lock {lock}: another process keeps re-creating it")


def _previous_configs(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "configs").glob("[0-9][0-9][0-9]-*.yaml"))


def _remove_outputs(out_dir: Path) -> None:
    for name in RUN_OUTPUTS + CONFIG_FILES:
        target = out_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def _outside(path: Path, out_dir: Path) -> bool:
    return not path.resolve().is_relative_to(out_dir.resolve())


def open_run_dir(config: RunConfig, *, resume: bool = False, overwrite: bool = False,
                 allow_config_change: bool = False, export_dir: str | Path | None = None,
                 input_dirs: tuple[str, ...] = ()) -> RunDirectory:
    """Claim `config.out_dir` for this run (see the module docstring); raises `RunDirError` when it cannot."""
    import jax

    out_dir = Path(config.out_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: continue the run, or start it over")
    export = Path(export_dir) if export_dir else None
    for source in input_dirs:
        if export is not None and Path(source).exists() and Path(source).resolve() == export.resolve():
            raise RunDirError(f"export_dir={export} is the run's input model.path; export elsewhere "
                              f"(default: out_dir/hf)")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"out_dir={out_dir} is a file, not a directory; choose a directory for the run's outputs")
    if jax.process_index() != 0:  # one process owns the directory; the others only read and write files
        return RunDirectory(out_dir, None)
    if resume and not (out_dir / "checkpoints").is_dir():
        raise RunDirError(f"--resume: {out_dir} has no checkpoints to resume from; start without --resume "
                          f"(with --overwrite if the directory holds other outputs)")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = _acquire_lock(out_dir)
    run_dir = RunDirectory(out_dir, lock)
    atexit.register(run_dir.release)
    try:
        previous = _previous_configs(out_dir)
        if not resume:
            previous = _start_fresh(out_dir, export, overwrite, previous)
        else:
            _check_resume_config(config, previous, allow_config_change)
        history = out_dir / "configs"
        history.mkdir(exist_ok=True)
        name = f"{len(previous) + 1:03d}-{'resume' if resume else 'start'}.yaml"
        (history / name).write_text(to_yaml(config))
        if not (out_dir / "config.yaml").exists():
            (out_dir / "config.yaml").write_text(to_yaml(config))
    except BaseException:
        run_dir.release()
        raise
    return run_dir


def _start_fresh(out_dir: Path, export: Path | None, overwrite: bool, previous: list[Path]) -> list[Path]:
    """A new start in `out_dir`: refuse another run's outputs (or a foreign export_dir holding files) unless
    `overwrite`, which removes our outputs; returns the config history that remains."""
    found = [name for name in RUN_OUTPUTS if (out_dir / name).exists()]
    foreign_export = export is not None and _outside(export, out_dir) and export.is_dir() and any(export.iterdir())
    if found and not overwrite:
        raise RunDirError(
            f"{out_dir} holds another run ({', '.join(found)}); continue it with --resume, or start over "
            f"with --overwrite (deletes those outputs), or choose another out_dir"
        )
    if foreign_export and not overwrite:
        raise RunDirError(f"export_dir={export} already holds files; choose another export_dir, or pass "
                          f"--overwrite to replace them when this run exports")
    if found:
        _notice(f"--overwrite: removing the previous run's outputs in {out_dir}")
        _remove_outputs(out_dir)
        previous = []
    if foreign_export:  # not ours to delete: its files are replaced when this run exports
        _notice(f"--overwrite: the export will replace the model files in {export}")
    (out_dir / "config.yaml").unlink(missing_ok=True)  # no run outputs: the config of this start
    return previous


def _check_resume_config(config: RunConfig, previous: list[Path], allow: bool) -> None:
    source = previous[-1] if previous else config_path_fallback(Path(config.out_dir))
    if source is None:
        _notice(f"--resume: {config.out_dir} keeps no config of the checkpointed run; not compared")
        return
    old = _current_names(yaml.safe_load(source.read_text()) or {})
    new = to_dict(config)
    changes = config_changes(old, new)
    unsafe = unsafe_changes(changes, config)
    safe = [c for c in changes if c not in unsafe]
    if unsafe and not allow:
        raise RunDirError(
            f"--resume with a config that changes the run's math or shapes ({_describe(unsafe)}; compared with "
            f"{source}); resume with the same settings, or pass --allow-config-change to continue anyway"
        )
    if unsafe:
        _notice(f"--allow-config-change: resuming with {_describe(unsafe)}")
    if safe:
        _notice(f"resuming with changed {_describe(safe)}")


def _current_names(old: dict[str, Any]) -> dict[str, Any]:
    """A config written by an earlier version, with its renamed keys under their current names (`grpo:` is
    `rl:`, `ratio_level: token|sequence` is `policy_loss: ppo_clip|gspo`), so such a run still resumes."""
    if "grpo" in old and "rl" not in old:
        rl = dict(old.pop("grpo") or {})
        if "ratio_level" in rl:
            rl["policy_loss"] = {"token": "ppo_clip", "sequence": "gspo"}.get(rl.pop("ratio_level"), "ppo_clip")
        old = {**old, "rl": rl}
    return old


def config_path_fallback(out_dir: Path) -> Path | None:
    """Runs from before the config history kept only `config.yaml`."""
    path = out_dir / "config.yaml"
    return path if path.is_file() else None
