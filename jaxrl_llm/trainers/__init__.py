"""The training algorithms, siblings on one loop shell (`loop.Trainer`).

`ALGORITHMS` maps `--algo` to the class that implements it (imported on first use, so the config can list the
choices without loading JAX models); `train(config)` runs one.
"""

from __future__ import annotations

import importlib
from typing import Any

ALGORITHMS: dict[str, str] = {
    "grpo": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "rloo": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "reinforce_pp": "jaxrl_llm.trainers.grpo:GRPOFamily",
    "ppo": "jaxrl_llm.trainers.ppo:PPO",
    "sft": "jaxrl_llm.trainers.sft:SFT",
    "rm": "jaxrl_llm.trainers.rm:RewardModelTraining",
    "dpo": "jaxrl_llm.trainers.dpo:DPO",
}


def algorithm_class(name: str) -> Any:
    module, _, attr = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_trainer(config: Any, **run_dir_options: Any) -> Any:
    """The loop shell around `config.algo` (`resume`, `overwrite`, `allow_config_change`, `config_dir`,
    `allow_tracked_dir`: see `run_dir.open_run_dir`)."""
    from jaxrl_llm.trainers.loop import Trainer

    return Trainer(config, algorithm_class(config.algo), **run_dir_options)


def train(config: Any, **run_dir_options: Any) -> dict[str, Any]:
    """Build the run of `config.algo` and execute it; returns the run's summary."""
    return make_trainer(config, **run_dir_options).run()
