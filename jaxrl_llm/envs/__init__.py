"""Environments and tools for multi-turn rollouts: the interface (`base.py`), tool calling (`tools.py`), the
built-in tools (a calculator, a sandboxed Python) and environments (`tool_use.py`), and adapters for
environment libraries. The environment owns its state; the trainer owns the tokens."""

from jaxrl_llm.envs import adapters, tool_use  # noqa: F401  (register the environments; libraries import lazily)
