"""The Python entry point: `jaxrl_llm.train(...)`, the command line's run with Python objects.

    import jaxrl_llm

    def correct(prompts, completions, answer, **fields):          # one reward per completion
        return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]

    summary = jaxrl_llm.train(
        {"model": {"path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "out_dir": "runs/mine", "steps": 50},
        reward_funcs=[correct],
        train_dataset=[{"prompt": "2+2=", "answer": "4"}, ...],     # a list of dicts or a datasets.Dataset
    )

It builds the same `RunConfig` as `train.py` (defaults < YAML file or mapping < keyword fields < dotted
overrides), checks it the same way, and runs the same loop shell; the return value is the run's summary.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import register_dataset
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.preflight import load_config, preflight
from jaxrl_llm.rewards import register_reward
from jaxrl_llm.trainers import train as run


def train(config: RunConfig | Mapping[str, Any] | str | Path | None = None, *,
          reward_funcs: Sequence[Callable[..., Sequence[float]] | str] | None = None,
          reward_weights: Sequence[float] | None = None, train_dataset: Any = None, eval_dataset: Any = None,
          overrides: Sequence[str] = (), resume: bool = False, overwrite: bool = False,
          allow_config_change: bool = False, allow_tracked_dir: bool = False, **fields: Any) -> dict[str, Any]:
    """Train and return the summary (`before` / `after` evaluation, `export`).

    config: a YAML file, a (nested) mapping of config fields, a `RunConfig`, or None (the defaults).
    reward_funcs: Python callables `(prompts, completions, **fields) -> list[float]` or reward names; they
      replace the config's `rewards`, weighted by `reward_weights` (default 1 each).
    train_dataset / eval_dataset: a list of dicts or a `datasets.Dataset` (records with a prompt and the
      fields the rewards read); they replace `data.train` / `data.eval`.
    overrides: dotted `section.field=value` strings; `fields`: top-level fields (`steps=10`).
    resume / overwrite / allow_config_change / allow_tracked_dir: as `train.py --resume / --overwrite /
      --allow-config-change / --allow-tracked-dir`.
    """
    path = config if isinstance(config, (str, Path)) else None
    base: dict[str, Any] = {}
    if isinstance(config, RunConfig):
        base = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        base = dict(config)
    elif config is not None and path is None:
        raise ConfigError(f"config must be a YAML path, a mapping or a RunConfig, not {type(config).__name__}")
    base.update(fields)
    bad_keys = [k for k in base if not isinstance(k, str)]
    if bad_keys:  # they would reach load_run_config(**base) as a bare TypeError
        raise ConfigError(f"config key {bad_keys[0]!r} in the Python API's config is not a string "
                          f"({type(bad_keys[0]).__name__}); config keys are field names such as 'model' or 'steps'")
    if isinstance(overrides, str):  # list("rl.beta=1") would be one override per character
        raise ConfigError(f"overrides={overrides!r} must be a list of 'key=value' strings, e.g. ['rl.beta=0.04']")
    if reward_funcs is not None:
        if callable(reward_funcs) or isinstance(reward_funcs, str) or not isinstance(reward_funcs, Sequence):
            raise ConfigError(f"reward_funcs must be a list of callables or reward names, not "
                              f"{type(reward_funcs).__name__} (e.g. reward_funcs=[my_reward])")
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ConfigError(f"reward_weights has {len(weights)} entries for {len(reward_funcs)} reward_funcs")
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, numbers.Real):  # numpy scalars are Real too
                raise ConfigError(f"reward_weights[{i}]={w!r} must be a number")
        names = [fn if isinstance(fn, str) else register_reward(fn) for fn in reward_funcs]
        base["rewards"] = [{"name": n, "weight": float(w)} for n, w in zip(names, weights, strict=True)]
    data = base.get("data") or {}
    if isinstance(data, Mapping):  # anything else: load_run_config's one-line error names the key and the type
        data = dict(data)
        if train_dataset is not None:
            data["train"] = register_dataset("train_dataset", train_dataset)
        if eval_dataset is not None:
            data["eval"] = register_dataset("eval_dataset", eval_dataset)
        if data:
            base["data"] = data
    run_config = load_config(path, list(overrides), **base)
    preflight(run_config, path, list(overrides), base)  # plugins, inputs, the devices: before any model loads

    return run(run_config, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
               config_dir=Path(path).parent if path is not None else None, allow_tracked_dir=allow_tracked_dir)
