"""A run's output directory: one run at a time, only its own files touched, every start's config kept.

    open_run_dir(config, resume=..., overwrite=..., allow_config_change=..., config_dir=...,
                 allow_tracked_dir=...) -> RunDirectory

- Ownership (`jaxrl_llm.run.manifest`): a run records what it creates in `out_dir/.jaxrl_llm-run.json`, and only a
  directory with that manifest is a run. `overwrite` removes exactly what the manifest lists, and refuses a
  directory that holds anything the run did not create (naming one such file).
- A new run takes a new or empty directory, or its config file's own folder (`config_dir`), where the files
  already there are left alone (listed as `kept`; one that is in the way of a run output refuses the start).
  Any other non-empty directory is refused, and so is a git work tree's root or a directory holding files
  tracked by git, unless `allow_tracked_dir`.
- A lock file (`out_dir/.lock`: PID, host, start time) marks the directory as in use; a second run into it
  stops with a message. A lock whose process is gone (same host) is stale and taken over with a notice.
- A resume needs a checkpoint, and compares the new config with the one the checkpointed run started with:
  changes to the math or shapes refuse unless `allow_config_change`; cadence changes proceed with a notice.
  The data files are compared with the content fingerprints recorded at the start (size, mtime, SHA-256).
- Each start's config is written to `configs/NNN-start.yaml` / `NNN-resume.yaml`; the first one is also
  `config.yaml` (unless a file of that name was there before the run). Nothing is overwritten.
- Runs made before the manifest resume as before (a manifest is started then); `overwrite` refuses them and
  names what it would have removed.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import yaml

from jaxrl_llm.config import RunConfig, to_dict, to_yaml
from jaxrl_llm.errors import RunDirError
from jaxrl_llm.run.config_history import config_changes, current_config, describe_changes, unsafe_changes
from jaxrl_llm.run.manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    claim,
    fingerprint,
    fingerprint_change,
    foreign_entry,
    new_manifest,
    owns,
    read_manifest,
    record_export,
    remove_created,
    write_manifest,
)

# What a run writes into its out_dir. Before manifests a run was recognised by these names; now they only say
# which existing files are in a new run's way (and what an old run without a manifest holds).
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard", "hf", "tokenizer",
               "corrupt_checkpoints", "diverged_checkpoints", "summary.json", "report", "eval", "wandb")
CONFIG_FILES = ("config.yaml", "configs")
# Existing files a run in its config's folder can leave alone: it then writes no config.yaml, and skips its
# end-of-run report (or `eval` writes elsewhere). Any other run output already there is in the way.
LEFT_ALONE_OK = ("config.yaml", "report", "eval")
DATA_FIELDS = ("train", "eval")  # data.<field>: the files fingerprinted for --resume


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


@dataclasses.dataclass
class RunDirectory:
    """An out_dir held by this process; `release()` removes the lock (also at interpreter exit).

    `claim(path)` records in the manifest that the run is about to create `path` (process 0 only)."""

    path: Path
    lock_file: Path | None
    primary: bool = True

    def claim(self, target: str | Path) -> None:
        if self.primary:
            claim(self.path, target)

    def claim_export(self, export_dir: str | Path) -> None:
        """Before exporting: inside the run, claim it; outside, record it as the run's export."""
        if self.primary:
            claim(self.path, export_dir)
            record_export(self.path, export_dir)

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


def _outside(path: Path, out_dir: Path) -> bool:
    return not path.resolve().is_relative_to(out_dir.resolve())


def _entries(out_dir: Path) -> list[str]:
    """The names in `out_dir`, without the lock (a stale one says nothing about what the directory holds)."""
    return sorted(p.name for p in out_dir.iterdir() if p.name != LOCK_NAME) if out_dir.is_dir() else []


def _is_legacy_run(out_dir: Path) -> bool:
    """A run from before manifests: checkpoints and the config history its starts wrote."""
    return (out_dir / "checkpoints").is_dir() and any((out_dir / n).exists() for n in CONFIG_FILES)


def _git_refusal(out_dir: Path) -> str | None:
    """Why `out_dir` is a place in a git work tree a run must not write into unasked, or None."""
    if not out_dir.is_dir():
        return None  # a new folder holds no tracked files, and a work tree's root exists already
    if (out_dir / ".git").exists():
        return f"out_dir={out_dir} is the root of a git work tree"
    if not any((parent / ".git").exists() for parent in out_dir.resolve().parents):
        return None
    try:
        listed = subprocess.run(["git", "-C", str(out_dir), "ls-files", "--cached", "--", "."], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):  # no git: the root check above is all we can do
        return None
    tracked = listed.stdout.splitlines() if listed.returncode == 0 else []
    if tracked:
        return f"out_dir={out_dir} holds files tracked by git ({tracked[0]}" + (", ...)" if len(tracked) > 1 else ")")
    return None


def open_run_dir(config: RunConfig, *, resume: bool = False, overwrite: bool = False,
                 allow_config_change: bool = False, export_dir: str | Path | None = None,
                 input_dirs: tuple[str, ...] = (), config_dir: str | Path | None = None,
                 allow_tracked_dir: bool = False) -> RunDirectory:
    """Claim `config.out_dir` for this run (see the module docstring); raises `RunDirError` when it cannot.

    `config_dir`: the folder of the YAML file the config came from (a new run may share it with files that
    are not its own); `allow_tracked_dir`: write into a git work tree's root or a directory with tracked files."""

    out_dir = Path(config.out_dir)
    export = Path(export_dir) if export_dir else None
    _check_arguments(out_dir, resume=resume, overwrite=overwrite, export=export, input_dirs=input_dirs)
    if jax.process_index() != 0:  # one process owns the directory; the others only read and write files
        return RunDirectory(out_dir, None, primary=False)
    if not allow_tracked_dir and (why := _git_refusal(out_dir)):
        raise RunDirError(f"{why}: a run's checkpoints and logs would mix with versioned files; choose another "
                          f"out_dir (e.g. runs/NAME), or pass --allow-tracked-dir to write there anyway")
    if resume and not (out_dir / "checkpoints").is_dir():
        raise RunDirError(f"--resume: {out_dir} has no checkpoints to resume from; start without --resume "
                          f"(with --overwrite if the directory holds another run)")
    manifest = read_manifest(out_dir)
    kept: list[str] = []
    if manifest is None and not resume and _entries(out_dir):  # before the lock: nothing written into it
        kept = _unowned_start(out_dir, overwrite, config_dir, export)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = _acquire_lock(out_dir)
    run_dir = RunDirectory(out_dir, lock)
    atexit.register(run_dir.release)
    try:
        if manifest is None:
            if resume:
                _notice(f"--resume: {out_dir} is a run from before jaxrl_llm recorded what runs create; from now "
                        f"on its new files are recorded in {MANIFEST_NAME}")
            manifest = new_manifest(kept, legacy=resume)
        previous = _previous_configs(out_dir)
        if resume:
            _check_resume_config(config, previous, allow_config_change)
            _check_resume_data(config, manifest, allow_config_change)
        else:
            previous = _start_fresh(out_dir, manifest, export, overwrite, previous)
        manifest["data"] = _data_fingerprints(config)
        write_manifest(out_dir, manifest)
        _record_config(run_dir, config, start=len(previous) + 1, resume=resume)
    except BaseException:
        run_dir.release()
        raise
    return run_dir


def _check_arguments(out_dir: Path, *, resume: bool, overwrite: bool, export: Path | None,
                     input_dirs: tuple[str, ...]) -> None:
    """The refusals that need nothing of `out_dir` but whether it is a file: `RunDirError` on the first."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other: continue the run, or start it over")
    for source in input_dirs:
        if export is not None and Path(source).exists() and Path(source).resolve() == export.resolve():
            raise RunDirError(f"export_dir={export} is the run's input model.path; export elsewhere "
                              f"(default: out_dir/hf)")
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"out_dir={out_dir} is a file, not a directory; choose a directory for the run's outputs")


def _record_config(run_dir: RunDirectory, config: RunConfig, *, start: int, resume: bool) -> None:
    """This start's config as `configs/NNN-start.yaml` (or `-resume`), and as `config.yaml` when there is none
    (a `config.yaml` the run did not write is left alone, with a notice)."""
    out_dir = run_dir.path
    history = out_dir / "configs"
    name = f"{start:03d}-{'resume' if resume else 'start'}.yaml"
    run_dir.claim(history / name)
    history.mkdir(exist_ok=True)
    (history / name).write_text(to_yaml(config))
    first = out_dir / "config.yaml"
    if not first.exists():
        run_dir.claim(first)
        first.write_text(to_yaml(config))
    elif not owns(out_dir, first) and not resume:
        _notice(f"{first} is not this run's (it was there before): left alone; this start's config is "
                f"{history / name}")


def _unowned_start(out_dir: Path, overwrite: bool, config_dir: str | Path | None, export: Path | None) -> list[str]:
    """A new run into a non-empty directory without a manifest: refused, unless it is the config file's own
    folder and no file there is in the way of a run output; returns the names it leaves alone."""
    entries = _entries(out_dir)
    if _is_legacy_run(out_dir):
        raise _legacy_refusal(out_dir, overwrite)
    if config_dir is None or not out_dir.resolve() == Path(config_dir).resolve():
        raise RunDirError(
            f"out_dir={out_dir} is not empty ({_example(out_dir, entries)}) and holds no run: a run writes into a "
            f"new or empty directory (or its config file's own folder); choose another out_dir" +
            ("; --overwrite removes only what a run created, so nothing was removed" if overwrite else "")
        )
    names = list(RUN_OUTPUTS + CONFIG_FILES)
    if export is not None and not _outside(export, out_dir):
        names.append(os.path.relpath(export, out_dir).split(os.sep)[0])
    blocking = [n for n in names if n in entries and n not in LEFT_ALONE_OK]
    if blocking:
        raise RunDirError(
            f"out_dir={out_dir} is the config file's folder and already holds {out_dir / blocking[0]}, which is not "
            f"this run's but has the name of a run output; move it, or choose another out_dir"
        )
    for name in LEFT_ALONE_OK:
        if name in entries and name != "config.yaml":
            _notice(f"{out_dir / name} is not this run's: left alone (the run writes no {name}/ there)")
    return entries


def _legacy_refusal(out_dir: Path, overwrite: bool) -> RunDirError:
    """A new start into a run from before manifests: what it holds is not known to be a run's, so no start
    (and no --overwrite) may delete it; the message names what an --overwrite would have removed."""
    old = ", ".join(n for n in RUN_OUTPUTS + CONFIG_FILES if (out_dir / n).exists())
    return RunDirError(
        f"{out_dir} holds a run from before jaxrl_llm recorded what runs create ({old}); continue it with --resume, "
        f"or choose another out_dir; to start over in it, delete {old} yourself" +
        (" (--overwrite removes only what a run recorded, so nothing was removed)" if overwrite else ""))


def _example(out_dir: Path, entries: list[str]) -> str:
    first = out_dir / entries[0]
    if first.is_dir():
        inner = sorted(first.rglob("*"))
        first = next((p for p in inner if p.is_file()), first)
    more = len(entries) - 1
    return f"it holds {first}" + (f" and {more} other entr{'y' if more == 1 else 'ies'}" if more else "")


def _start_fresh(out_dir: Path, manifest: dict[str, Any], export: Path | None, overwrite: bool,
                 previous: list[Path]) -> list[Path]:
    """A new start in a directory with a manifest: refuse the run's outputs (or a foreign export_dir holding
    files) unless `overwrite`, which removes exactly what the run created; returns the config history kept."""
    if manifest.get("legacy"):  # what the run wrote before its manifest is unknown: never ours to delete
        raise _legacy_refusal(out_dir, overwrite)
    created = [rel for rel in manifest["created"] if (out_dir / rel).exists()]
    found = [rel for rel in created if rel.split("/")[0] not in CONFIG_FILES]
    foreign_export = export is not None and _outside(export, out_dir) and export.is_dir() and any(export.iterdir())
    if found and not overwrite:
        raise RunDirError(
            f"{out_dir} holds another run ({', '.join(found[:6])}{', ...' if len(found) > 6 else ''}); continue it "
            f"with --resume, or start over with --overwrite (deletes what that run created), or choose another "
            f"out_dir"
        )
    if foreign_export and not overwrite:
        raise RunDirError(f"export_dir={export} already holds files; choose another export_dir, or pass "
                          f"--overwrite to replace them when this run exports (only an export this run wrote)")
    if foreign_export and str(export.resolve()) not in manifest.get("exports", []):
        raise RunDirError(f"--overwrite: export_dir={export} holds files that no start of this run exported; "
                          f"nothing was removed: choose an empty or new export_dir")
    if found:
        foreign = foreign_entry(out_dir, manifest)
        if foreign is not None:
            raise RunDirError(
                f"--overwrite: {out_dir} holds {foreign}, which the run did not create; --overwrite removes only "
                f"what the run created, so nothing was removed: move {foreign.name} out, or choose another out_dir")
        removed = remove_created(out_dir, manifest)
        _notice(f"--overwrite: removed what the previous run created in {out_dir}: {', '.join(removed)}")
        previous = []
    elif created:  # a start that failed before its first step left only its config: this start replaces it
        first = out_dir / "config.yaml"
        if "config.yaml" in manifest["created"]:
            first.unlink(missing_ok=True)
    if foreign_export:  # an earlier start's export: its model files are replaced when this run exports
        _notice(f"--overwrite: the export will replace the model files this run wrote to {export}")
    return previous


def _data_fingerprints(config: RunConfig) -> dict[str, Any]:
    """`data.<field>` -> fingerprint, for the data fields that name a local file."""
    out = {}
    for name in DATA_FIELDS:
        value = getattr(config.data, name, "")
        if value and Path(value).is_file():
            out[f"data.{name}"] = fingerprint(Path(value))
    return out


def _check_resume_data(config: RunConfig, manifest: dict[str, Any], allow: bool) -> None:
    """Refuse a resume whose data files changed since the run recorded them (`allow`: warn and go on)."""
    recorded = manifest.get("data") or {}
    if not recorded:
        if any(getattr(config.data, n, "") for n in DATA_FIELDS):
            _notice(f"--resume: {config.out_dir} recorded no data fingerprints (a run from an earlier version); "
                    f"the data files are not compared")
        return
    for key, old in recorded.items():
        value = getattr(config.data, key.removeprefix("data."), "")
        if not value or Path(value).resolve() != Path(old.get("path", "")).resolve():
            continue  # a changed path is a config change, compared (and refused) with the config
        change = fingerprint_change(old, Path(value))
        if change is None:
            continue
        if not allow:
            raise RunDirError(
                f"--resume: {key} file {value} changed since the run started ({change}); resume with the same "
                f"data, or pass --allow-config-change to continue on the changed file")
        _notice(f"--allow-config-change: resuming on the changed {key} file {value} ({change})")


def _check_resume_config(config: RunConfig, previous: list[Path], allow: bool) -> None:
    source = previous[-1] if previous else config_path_fallback(Path(config.out_dir))
    if source is None:
        _notice(f"--resume: {config.out_dir} keeps no config of the checkpointed run; not compared")
        return
    old = current_config(yaml.safe_load(source.read_text()) or {})
    new = to_dict(config)
    changes = config_changes(old, new)
    unsafe = unsafe_changes(changes, config)
    safe = [c for c in changes if c not in unsafe]
    if unsafe and not allow:
        raise RunDirError(
            f"--resume with a config that changes the run's math or shapes ({describe_changes(unsafe)}; compared with "
            f"{source}); resume with the same settings, or pass --allow-config-change to continue anyway"
        )
    if unsafe:
        _notice(f"--allow-config-change: resuming with {describe_changes(unsafe)}")
    if safe:
        _notice(f"resuming with changed {describe_changes(safe)}")


def config_path_fallback(out_dir: Path) -> Path | None:
    """Runs from before the config history kept only `config.yaml`."""
    path = out_dir / "config.yaml"
    return path if path.is_file() else None
