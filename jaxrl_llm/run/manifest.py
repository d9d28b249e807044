"""What a run owns: the manifest `out_dir/.jaxrl_llm-run.json`, written by the run itself.

Only a directory with a manifest is a run. The manifest lists, as paths relative to the run directory, what the
run (its starts and resumes, and the commands that write into it: eval, report) created, plus what was already
there when its first start began and was left alone:

    {"format": 1, "created": ["checkpoints", "configs", "metrics.jsonl", ...], "kept": ["config.yaml", ...],
     "data": {"data.train": {"path", "size", "mtime_ns", "sha256"}, ...}, "exports": [ABSOLUTE_DIR, ...],
     "legacy": false}

`claim(run_dir, target)` is called *before* `target` is written: it records the shortest part of `target`'s
path that does not exist yet (so a file written into a folder the run did not create is recorded alone, and
the folder is not); `record_export` records an export_dir outside the run. `foreign_entry` finds a path the
run did not create; `remove_created` deletes exactly the created paths. `data` holds a content fingerprint of
each data file (`fingerprint`), compared on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST_NAME = ".jaxrl_llm-run.json"
LOCK_NAME = ".lock"
FORMAT = 1
_HASH_CHUNK = 1 << 20


def manifest_path(run_dir: Path) -> Path:
    return Path(run_dir) / MANIFEST_NAME


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The manifest of `run_dir`, or None when it has none (not a run, or a run from before manifests)."""
    path = manifest_path(run_dir)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a manifest cut by a crash: a run still, whose records are lost
        return {"format": FORMAT, "created": [], "kept": [], "data": {}, "legacy": True}
    if not isinstance(manifest, dict):
        return {"format": FORMAT, "created": [], "kept": [], "data": {}, "legacy": True}
    for key in ("created", "kept"):
        manifest[key] = [str(p) for p in manifest.get(key) or []]
    manifest.setdefault("data", {})
    return manifest


def new_manifest(kept: list[str], *, legacy: bool = False) -> dict[str, Any]:
    return {"format": FORMAT, "created": [], "kept": sorted(kept), "data": {}, "legacy": legacy}


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write atomically (a crash leaves the old manifest or the new one, never half of one)."""
    path = manifest_path(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    manifest["created"] = sorted(set(manifest["created"]))
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)


def _relative(run_dir: Path, target: Path) -> tuple[str, ...] | None:
    try:
        return Path(os.path.abspath(target)).relative_to(os.path.abspath(run_dir)).parts
    except ValueError:
        return None


def claim(run_dir: str | Path, target: str | Path) -> None:
    """Record in `run_dir`'s manifest that this run is about to create `target` (call before writing it).

    The shortest prefix of `target` that does not exist yet is recorded; nothing is recorded when `run_dir`
    has no manifest, when `target` lies outside it, or when a prefix is already the run's own."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    parts = _relative(run_dir, Path(target))
    if manifest is None or not parts:
        return
    created = set(manifest["created"])
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if prefix in created:
            return
        if not (run_dir / prefix).exists():
            manifest["created"].append(prefix)
            write_manifest(run_dir, manifest)
            return


def unowned_existing(run_dir: str | Path, target: str | Path) -> bool:
    """True when `target` exists inside the run `run_dir` (one with a manifest) but is not the run's: a command
    must then leave it alone rather than write into it."""
    run_dir, target = Path(run_dir), Path(target)
    return (target.exists() and read_manifest(run_dir) is not None and bool(_relative(run_dir, target))
            and not owns(run_dir, target))


def record_export(run_dir: str | Path, export_dir: str | Path) -> None:
    """Record an export outside the run's directory (its absolute path), so that `--overwrite` may replace
    that export, and no other directory's files."""
    manifest = read_manifest(Path(run_dir))
    if manifest is None or _relative(Path(run_dir), Path(export_dir)):
        return
    target = str(Path(export_dir).resolve())
    if target not in manifest.setdefault("exports", []):
        manifest["exports"].append(target)
        write_manifest(Path(run_dir), manifest)


def owns(run_dir: Path, target: Path) -> bool:
    """True when `target` (or a folder above it inside `run_dir`) was created by the run."""
    manifest = read_manifest(run_dir)
    parts = _relative(run_dir, target)
    if manifest is None or not parts:
        return False
    created = set(manifest["created"])
    return any("/".join(parts[:i]) in created for i in range(1, len(parts) + 1))


def foreign_entry(run_dir: Path, manifest: dict[str, Any]) -> Path | None:
    """A path in `run_dir` that the run neither created nor found there at its first start, or None.

    Folders that hold some of the run's files (a user's folder it wrote one file into) are searched inside."""
    created, kept = set(manifest["created"]), set(manifest["kept"])

    def search(folder: Path, prefix: str) -> Path | None:
        for entry in sorted(folder.iterdir()):
            rel = f"{prefix}{entry.name}"
            if not prefix and entry.name in (MANIFEST_NAME, f"{MANIFEST_NAME}.tmp", LOCK_NAME):
                continue
            if rel in created or rel in kept:
                continue
            if entry.is_dir() and not entry.is_symlink() and any(c.startswith(rel + "/") for c in created):
                found = search(entry, rel + "/")
                if found is not None:
                    return found
                continue
            return entry
        return None

    return search(run_dir, "")


def remove_created(run_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """Delete every path the manifest lists as created (and nothing else); returns them. The manifest's
    `created` list is emptied and written back."""
    removed = []
    for rel in sorted(manifest["created"], key=lambda p: -p.count("/")):  # files in kept folders first
        target = run_dir / rel
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        else:
            continue
        removed.append(rel)
    manifest["created"] = []
    manifest["data"] = {}
    write_manifest(run_dir, manifest)
    return sorted(removed)


# ------------------------------------------------------------------------------------------ data fingerprints


def fingerprint(path: Path) -> dict[str, Any]:
    """Size, modification time and the SHA-256 of `path`'s bytes (read in 1 MiB chunks, never whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": digest.hexdigest()}


def fingerprint_change(recorded: dict[str, Any], path: Path) -> str | None:
    """How `path` differs from its recorded fingerprint (a short phrase), or None when its bytes are the same.
    Size and mtime unchanged count as unchanged without reading the file; otherwise the hash decides."""
    if not path.is_file():
        return "it no longer exists"
    st = path.stat()
    if st.st_size == recorded.get("size") and st.st_mtime_ns == recorded.get("mtime_ns"):
        return None
    now = fingerprint(path)
    if now["sha256"] == recorded.get("sha256"):
        return None  # touched, same bytes
    if now["size"] != recorded.get("size"):
        return f"{recorded.get('size')} -> {now['size']} bytes"
    return f"same size, different bytes (sha256 {str(recorded.get('sha256'))[:12]} -> {now['sha256'][:12]})"
