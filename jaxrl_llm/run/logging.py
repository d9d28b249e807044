"""Run outputs: metrics to JSONL, TensorBoard and (`logging.wandb`) Weights & Biases, sample completions to JSONL,
and the console: a tqdm progress
bar on a terminal, or (output to a file or pipe, as on a cluster, or `progress_bar=false`) one plain line per
logged step, so a log file reads line by line.

One row per step, whatever happened: a resumed run first drops the rows of the steps after its checkpoint
(they are replayed identically) from `metrics.jsonl` and `samples.jsonl`, and rebuilds the TensorBoard events
from the rows kept, so neither holds a step twice.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

from jaxrl_llm.errors import ConfigError, StorageError


def start_wandb(out_dir: Path, project: str, mode: str, config: dict[str, Any] | None) -> Any:
    """A W&B run in `out_dir/wandb` (`mode` offline: no network, `wandb sync` uploads it later); a clear
    `ConfigError` when the package is missing."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("logging.wandb=true needs the wandb package, which is not installed: pip install wandb "
                          "(or pip install 'jaxrl_llm[wandb]'), or set logging.wandb=false") from e
    (out_dir / "wandb").mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, dir=str(out_dir), mode=mode, name=out_dir.name, config=config or {})


def _plain(value: Any) -> Any:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return value
    return value if math.isfinite(value) else str(value)


class RunLogger:
    """Writes `metrics.jsonl`, `samples.jsonl` and TensorBoard events under `out_dir`; owns the progress bar.

    In a multi-process run only process 0 writes (every process computes the same metrics)."""

    def __init__(self, out_dir: str | Path, *, total_steps: int, initial_step: int = 0,
                 tensorboard: bool = True, progress_bar: bool = True, desc: str = "train",
                 resume_step: int | None = None, wandb: dict[str, Any] | None = None) -> None:
        """`wandb`: `{"project", "mode", "config"}` to also send every row to Weights & Biases (process 0)."""

        primary = jax.process_index() == 0
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, Any]] = []
        if primary and resume_step is not None:
            kept = truncate_rows(self.out_dir / "metrics.jsonl", resume_step)
            truncate_rows(self.out_dir / "samples.jsonl", resume_step)
            if (self.out_dir / "tensorboard").is_dir():
                shutil.rmtree(self.out_dir / "tensorboard")
        self.metrics_file = (self.out_dir / "metrics.jsonl").open("a") if primary else open(os.devnull, "w")  # noqa: SIM115
        self.samples_file = (self.out_dir / "samples.jsonl").open("a") if primary else open(os.devnull, "w")  # noqa: SIM115
        self.primary, self.total_steps = primary, total_steps
        # tqdm draws on stderr: anywhere but a terminal its redraws would make the log one long line.
        self.plain = primary and not (progress_bar and sys.stderr.isatty())
        progress_bar = progress_bar and primary and not self.plain
        self.writer = None
        if tensorboard and primary:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"))
            for row in kept:
                self._scalars(row)
        self.wandb = start_wandb(self.out_dir, wandb["project"], wandb["mode"], wandb.get("config")) \
            if wandb is not None and primary else None
        self.bar = tqdm(total=total_steps, initial=initial_step, desc=desc, disable=not progress_bar,
                        dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        _append(self.metrics_file, json.dumps(row) + "\n")
        self._scalars(row)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, float)}, step=step)

    def _scalars(self, row: dict[str, Any]) -> None:
        if self.writer is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, float):
                    self.writer.add_scalar(name, value, row["step"])

    def progress(self, postfix: dict[str, float], advance: int = 1) -> None:
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        self.bar.update(advance)

    def line(self, step: int, fields: dict[str, float]) -> None:
        """The plain log line of a step (only when there is no progress bar)."""
        if self.plain:
            values = "  ".join(f"{v:.2f} s/step" if k == "s/step" else f"{k} {v:.4g}" for k, v in fields.items())
            print(f"step {step}/{self.total_steps}  {values}", flush=True)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        _append(self.samples_file, "".join(json.dumps({"step": step, **row}) + "\n" for row in rows))

    def message(self, text: str) -> None:
        if self.primary:
            self.bar.write(text)
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
        self.metrics_file.close()
        self.samples_file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _append(file: Any, text: str) -> None:
    """Write and flush `text`; a refused write (disk full) is a `StorageError` naming the file."""
    try:
        file.write(text)
        file.flush()
    except OSError as e:
        raise StorageError(f"{(e.strerror or str(e)).lower()} while writing {file.name}") from None


def truncate_rows(path: Path, last_step: int) -> list[dict[str, Any]]:
    """Keep only the JSONL rows of `path` with `step <= last_step` (rewritten atomically); returns them."""
    if not path.is_file():
        return []
    kept, lines = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(row)
            lines.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)
    return kept


def write_summary(out_dir: str | Path, summary: dict[str, Any]) -> None:
    """`out_dir/summary.json`: the run's before/after evaluation, export and divergence verdict."""

    if jax.process_index() == 0:
        path = Path(out_dir) / "summary.json"
        try:
            path.write_text(json.dumps(summary, indent=2, default=_plain) + "\n")
        except OSError as e:
            raise StorageError(f"{(e.strerror or str(e)).lower()} while writing {path}") from None
