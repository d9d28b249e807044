"""The training algorithms, siblings on one loop shell (`loop.Trainer`) under one contract (`base.Algorithm`).

`ALGORITHMS` maps `--algo` to the class that implements it (imported on first use); `validate(config)` runs the
algorithm's own checks, `check_devices(config)` those against the devices JAX sees; `train(config)` runs one.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax

from jaxrl_llm.config import ConfigError, RunConfig
from jaxrl_llm.sharding import MeshShape
from jaxrl_llm.trainers.loop import Trainer

ALGORITHMS: dict[str, str] = {
    "grpo": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "rloo": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "reinforce_pp": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "ppo": "jaxrl_llm.trainers.ppo:PPO",
    "sft": "jaxrl_llm.trainers.sft:SFT",
    "rm": "jaxrl_llm.trainers.rm:RewardModelTraining",
    "dpo": "jaxrl_llm.trainers.dpo:DPO",
    "distill": "jaxrl_llm.trainers.distill:Distillation",
}


def algorithm_class(name: str) -> Any:
    """The class of `--algo name`; a one-line `ConfigError` for a name no algorithm has."""
    if name not in ALGORITHMS:
        raise ConfigError(f"algo={name!r}: expected one of {', '.join(ALGORITHMS)}")
    module, _, attr = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def validate(config: RunConfig) -> None:
    """The algorithm's own checks of `config` (`Algorithm.validate`): one-line `ConfigError`s."""
    algorithm_class(config.algo).validate(config)


def check_devices(c: RunConfig) -> None:
    """The mesh fits the devices JAX sees, and the algorithm's micro-batch splits over its data axes."""
    try:
        data, fsdp, _ = MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor).resolve(jax.device_count())
    except ValueError as e:
        raise ConfigError(f"mesh.data={c.mesh.data}, mesh.fsdp={c.mesh.fsdp}, mesh.tensor={c.mesh.tensor}: "
                          f"{str(e).split(': ', 1)[-1]}") from e
    if c.sampling.engine == "paged" and jax.device_count() > 1:
        raise ConfigError(f"sampling.engine=paged samples on one device and JAX sees {jax.device_count()}: use "
                          "sampling.engine=static on a mesh of several devices")
    micro = algorithm_class(c.algo).micro_batch(c)
    if micro is not None and micro[1] % (data * fsdp):
        raise ConfigError(f"{micro[0]} must be divisible by mesh.data * mesh.fsdp ({data * fsdp}) for the "
                          f"data-parallel step")


def make_trainer(config: RunConfig, **run_dir_options: Any) -> Any:
    """The loop shell around `config.algo`, after the algorithm's checks (`resume`, `overwrite`,
    `allow_config_change`, `config_dir`, `allow_tracked_dir`: see `run_dir.open_run_dir`)."""
    validate(config)
    check_devices(config)
    return Trainer(config, algorithm_class(config.algo), **run_dir_options)


def train(config: RunConfig, **run_dir_options: Any) -> dict[str, Any]:
    """Build the run of `config.algo` and execute it; returns the run's summary."""
    return make_trainer(config, **run_dir_options).run()
