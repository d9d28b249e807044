"""The training algorithms, siblings on one loop shell (`loop.Trainer`) under one contract (`base.Algorithm`).

`algorithm_class(name)` is the class `--algo name` runs (`jaxrl_llm/algorithms.py` lists them; imported on first
use); `validate(config)` runs the algorithm's own checks, `check_devices(config)` those against the devices JAX
sees; `train(config)` runs one.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_llm.algorithms import ALGORITHMS
from jaxrl_llm.config import ConfigError, RunConfig
from jaxrl_llm.registry import import_named
from jaxrl_llm.sharding import MeshShape
from jaxrl_llm.trainers.loop import Trainer


def algorithm_class(name: str) -> Any:
    """The class of `--algo name`; a one-line `ConfigError` for a name no algorithm has."""
    if name not in ALGORITHMS:
        raise ConfigError(f"algo={name!r}: expected one of {', '.join(ALGORITHMS)}")
    return import_named(ALGORITHMS[name].target, "algo")


def validate(config: RunConfig) -> None:
    """The algorithm's own checks of `config` (`Algorithm.validate`), and whether it can sample beside training
    (`rollout.*`): one-line `ConfigError`s."""
    cls = algorithm_class(config.algo)
    r = config.rollout
    if (r.max_staleness or r.sampler_devices) and cls.no_overlap:
        raise ConfigError(f"rollout.max_staleness={r.max_staleness}, rollout.sampler_devices={r.sampler_devices} "
                          f"with algo={config.algo}: {cls.no_overlap}; set both to 0")
    mode = config.rl.loss.rollout_correction
    if r.max_staleness and mode in ("none", "recompute") and not r.allow_uncorrected:
        # recompute alone makes the update's ratio start from the current policy, with nothing for the older one
        # that sampled: as uncorrected as none
        raise ConfigError(f"rollout.max_staleness={r.max_staleness} with rl.loss.rollout_correction={mode}: rollouts "
                          f"up to {r.max_staleness} policy versions old need an importance correction (token_truncate,"
                          f" the default with rollout.max_staleness > 0); or set rollout.allow_uncorrected=true")
    cls.validate(config)


def check_devices(c: RunConfig) -> None:
    """The mesh fits the devices JAX sees, and the algorithm's micro-batch splits over its data axes."""
    n = c.rollout.sampler_devices
    if n and jax.process_count() > 1:
        raise ConfigError(f"rollout.sampler_devices={n} with {jax.process_count()} processes: a sampler mesh of its "
                          f"own runs in one process; set rollout.sampler_devices=0 (one mesh)")
    if n >= jax.device_count():
        raise ConfigError(f"rollout.sampler_devices={n}: JAX sees {jax.device_count()} device(s) and the trainer "
                          f"needs at least one; set it to at most {jax.device_count() - 1}")
    t = c.rollout.sampler_tensor
    if t > 1 and (not n or n % t):
        raise ConfigError(f"rollout.sampler_tensor={t} with rollout.sampler_devices={n}: the sampler's own devices "
                          f"must split into groups of {t} (sampler_devices a multiple of it, not 0)")
    trainer_devices = jax.device_count() - n
    try:
        data, fsdp, expert, _ = MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, expert=c.mesh.expert,
                                          sequence=c.mesh.sequence).resolve(trainer_devices)
    except ValueError as e:
        raise ConfigError(f"mesh.data={c.mesh.data}, mesh.fsdp={c.mesh.fsdp}, mesh.tensor={c.mesh.tensor}, "
                          f"mesh.expert={c.mesh.expert}, mesh.sequence={c.mesh.sequence}: "
                          f"{str(e).split(': ', 1)[-1]}" + (f" (the trainer's {trainer_devices} of "
                          f"{jax.device_count()}, rollout.sampler_devices={n})" if n else "")) from e
    micro = algorithm_class(c.algo).micro_batch(c)
    if micro is not None and micro[1] % (data * fsdp * expert):
        raise ConfigError(f"{micro[0]} must be divisible by mesh.data * mesh.fsdp * mesh.expert "
                          f"({data * fsdp * expert}) for the data-parallel step")


def make_trainer(config: RunConfig, **run_dir_options: Any) -> Any:
    """The loop shell around `config.algo`, after the algorithm's checks (`resume`, `overwrite`,
    `allow_config_change`, `config_dir`, `allow_tracked_dir`: see `run_dir.open_run_dir`)."""
    validate(config)
    check_devices(config)
    return Trainer(config, algorithm_class(config.algo), **run_dir_options)


def train(config: RunConfig, **run_dir_options: Any) -> dict[str, Any]:
    """Build the run of `config.algo` and execute it; returns the run's summary."""
    return make_trainer(config, **run_dir_options).run()
