"""The environment interface, small and gym-like, and its registry.

    env = make_environment(spec, kwargs)(record)        one environment per rollout row, built from its record
    messages = env.reset()                               the opening conversation: [{"role", "content"}, ...]
    result = env.step(assistant_text)                    StepResult(messages, reward, done, info)

`step` gets the text of the model's turn (decoded from the sampled tokens, which the trainer keeps as they are)
and answers with the messages that follow it (tool results, a user's reply), a reward for the turn, and whether
the episode is over. The trainer renders those messages with the tokenizer's chat template and appends their
tokens, masked out of the loss. An environment that misbehaves (raises, or takes longer than its timeout) ends its
episode with an error observation in `info`; it never stalls or kills the run.

Environments are named like rewards: a registered name (`register_environment`) or `module:function`, a factory
called as `factory(record, **kwargs)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.registry import resolve_name

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": str, ...}


class StepResult(NamedTuple):
    """What the environment answers to one assistant turn."""

    messages: list[Message]  # what follows the model's turn (tool results, a reply); [] when done
    reward: float = 0.0  # this turn's reward (summed over the episode with the run's reward functions)
    done: bool = False
    info: dict[str, Any] = {}  # counters the trainer logs: tool_calls, tool_errors, ...


class Environment(Protocol):
    def reset(self) -> list[Message]: ...
    def step(self, assistant_text: str) -> StepResult: ...


EnvironmentFactory = Callable[..., Environment]
ENVIRONMENTS: dict[str, EnvironmentFactory] = {}


def register_environment(name: str) -> Callable[[EnvironmentFactory], EnvironmentFactory]:
    """Decorator: make `factory(record, **kwargs) -> Environment` available as `env.name: NAME`."""

    def add(factory: EnvironmentFactory) -> EnvironmentFactory:
        ENVIRONMENTS[name] = factory
        return factory

    return add


def resolve_environment(name: str) -> EnvironmentFactory:
    """The factory of a registered name or of a `module:function`; a one-line `ConfigError` naming `env.name`."""

    def register(key: str, factory: Any) -> None:
        if not callable(factory):
            raise ConfigError(f"env.name={key!r} is not callable (a factory: record, **kwargs -> environment)")
        ENVIRONMENTS[key] = factory

    return ENVIRONMENTS[resolve_name("env.name", name, ENVIRONMENTS, register, "docs/environments.md")]
