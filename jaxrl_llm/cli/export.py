"""Write any checkpoint step of a run as a Hugging Face directory; read models for `eval` and `compare`.

    python -m jaxrl_llm export RUN_DIR [--step N] --out DIR

The run's algorithm is rebuilt from its config (the last start's, `RUN_DIR/configs/NNN-*.yaml`, else
`config.yaml`; relative paths in it are relative to the folder training ran from), the checkpoint of step N
(default: the latest) is restored into it, and the algorithm's own `export` writes the directory: the policy
(LoRA merged, as at the end of a run) or, for `--algo rm`, the reward model.

`load_model(spec)` is what `eval` and `compare` read: `DIR` (a HF directory), `RUN_DIR` (the latest checkpoint)
or `RUN_DIR:STEP`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from jax.sharding import PartitionSpec

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.config import load_run_config
from jaxrl_llm.errors import ConversionError, UsageError
from jaxrl_llm.models.hf import load_hf_model, resolve_model_dir
from jaxrl_llm.models.tokenizer import eos_token_ids, load_tokenizer
from jaxrl_llm.run.checkpoint import WEIGHT_KEYS, Checkpointer, abstract_like
from jaxrl_llm.run.manifest import claim
from jaxrl_llm.sharding import global_array
from jaxrl_llm.trainers import algorithm_class


def is_run_dir(path: Path) -> bool:
    """A training run's out_dir: it has a `checkpoints/` folder and a config."""
    return (path / "checkpoints").is_dir() and ((path / "config.yaml").is_file() or (path / "configs").is_dir())


def run_config_path(run_dir: Path) -> Path:
    """The config of the run's last start (`configs/NNN-*.yaml`), else `config.yaml`."""
    history = sorted((run_dir / "configs").glob("[0-9][0-9][0-9]-*.yaml"))
    if history:
        return history[-1]
    if (run_dir / "config.yaml").is_file():
        return run_dir / "config.yaml"
    raise UsageError(f"{run_dir} has no config.yaml: not a run directory of train.py")


def run_config(run_dir: Path) -> Any:
    """The `RunConfig` the run trained with, its `out_dir` set to `run_dir`."""

    tree = yaml.safe_load(run_config_path(run_dir).read_text()) or {}
    tree["out_dir"] = str(run_dir)
    return load_run_config(None, [], **tree)


def split_spec(spec: str) -> tuple[Path, int | None]:
    """`DIR` or `DIR:STEP` -> (path, step or None). A path that exists as written is never split."""
    if Path(spec).exists():
        return Path(spec), None
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        return Path(head), int(tail)
    if sep and head and Path(head).exists():
        raise UsageError(f"{spec!r}: the step after ':' must be a whole number (e.g. {head}:50)")
    raise UsageError(f"{spec}: no such model directory or run directory")


@dataclasses.dataclass
class RunStep:
    """A run's algorithm and the state of one checkpoint step."""

    run_dir: Path
    step: int
    config: Any
    algorithm: Any
    state: Any


def load_run_step(run_dir: str | Path, step: int | None = None) -> RunStep:
    """Rebuild the run's algorithm and restore the checkpoint of `step` (default: the latest) into it."""

    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        raise UsageError(f"{run_dir} is not a run directory (no checkpoints/ and config.yaml in it)")
    config = run_config(run_dir)
    checkpoints = Checkpointer(run_dir / "checkpoints")
    try:
        steps = sorted(checkpoints.all_steps())
        if not steps:
            raise UsageError(f"{run_dir}/checkpoints holds no finished checkpoint (was checkpoint_every=0?)")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise UsageError(f"{run_dir} has no checkpoint of step {step} (kept: {', '.join(map(str, steps))}; "
                             f"keep_checkpoints decides how many stay)")
        algorithm = algorithm_class(config.algo)(config)
        key = global_array(np.zeros(2, np.uint32), algorithm.mesh, PartitionSpec())
        initial = algorithm.init()
        like = {**initial, "key": key}
        if checkpoints._weights_only(step):
            like = {k: like[k] for k in WEIGHT_KEYS}
        try:
            state, _ = checkpoints.restore(step, abstract_like(like))
        except Exception as e:
            raise ConversionError(f"the checkpoint of step {step} in {run_dir}/checkpoints cannot be read: "
                                  f"{type(e).__name__}: {e}") from e
    finally:
        checkpoints.close()
    state.pop("key")
    if "opt_state" not in state:  # weights-only: keep the freshly initialised rest
        state = {**initial, **state}
    return RunStep(run_dir, step, config, algorithm, state)


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready to sample: its weights, architecture, tokenizer and stop / pad ids."""

    name: str  # as the user gave it
    params: Any
    model_config: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    run: RunStep | None = None  # set when read from a run's checkpoint


def load_model(spec: str) -> LoadedModel:
    """`DIR` (a HF directory or hub id), `RUN_DIR` (its latest checkpoint) or `RUN_DIR:STEP`."""

    path, step = split_spec(spec) if (":" in spec or Path(spec).exists()) else (Path(spec), None)
    if is_run_dir(path):
        run = load_run_step(path, step)
        policy = getattr(run.algorithm, "policy", None)
        if policy is None:
            raise UsageError(f"{spec}: a --algo {run.config.algo} run has no policy to generate with")
        weights = policy.model_weights(run.state["params"])
        return LoadedModel(spec, weights, policy.model_config, policy.tokenizer, policy.eos_ids,
                           policy.pad_id, run)
    if step is not None:
        raise UsageError(f"{spec}: {path} is not a run directory (no checkpoints/), so it has no step {step}")
    model_dir = resolve_model_dir(str(path))
    tokenizer = load_tokenizer(model_dir)
    model_config, params = load_hf_model(model_dir)
    return LoadedModel(spec, params, model_config, tokenizer, eos_token_ids(model_dir, tokenizer),
                       int(tokenizer.pad_token_id), None)


def export_step(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[str, int]:
    """Write the checkpoint of `step` (default: the latest) of `run_dir` as a HF directory at `out`;
    returns (the directory, the step)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} already holds files; choose an empty or new directory")
    run = load_run_step(run_dir, step)
    claim(run_dir, out)  # an export written into the run's folder is the run's (--overwrite removes it)
    return run.algorithm.export(run.state, out), run.step


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jaxrl_llm export", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a training run's out_dir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    directory, step = export_step(args.run_dir, args.out, args.step)
    if jax.process_index() == 0:
        print(f"exported step {step} of {args.run_dir} to {directory}")
    return 0

