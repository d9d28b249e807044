"""jaxrl_llm: RL post-training of language models in JAX. `jaxrl_llm.train(...)` runs a training job from
Python (see `jaxrl_llm.api`); `python train.py` is the same from the command line."""

from jaxrl_llm.api import train

__all__ = ["train"]
