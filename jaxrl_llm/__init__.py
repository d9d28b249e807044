"""jaxrl_llm: RL post-training of language models in JAX. `jaxrl_llm.train(...)` runs a training job from
Python (see `jaxrl_llm.api`); `python train.py` is the same from the command line."""

import importlib
from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    # `jaxrl_llm.train` loads the trainers (JAX, Flax, orbax) on first use, so importing a light part of the
    # package (the config, the errors, a command's --help) does not.
    if name == "train":
        return importlib.import_module("jaxrl_llm.api").train
    raise AttributeError(f"module 'jaxrl_llm' has no attribute {name!r}")
