"""The built-in environments: a task the model may solve with tools, and the one-turn case.

`tool_use`: the record's prompt opens the episode. A turn with tool calls (parsed in `tool_format`:
`tool_formats.py`) is answered with their results, one `{"role": "tool"}` message per call as the format renders it
(an error observation for a malformed call, an unknown tool or a tool that fails); the first turn without a call is
the answer, and ends the episode. The run's reward functions score that
answer (`math_answer` against the record's `answer`, say); the environment adds no reward of its own.

`single_turn`: the prompt, one reply, done: a multi-turn rollout of it is a single-turn rollout.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.envs.base import Message, StepResult, register_environment
from jaxrl_llm.envs.tool_formats import TOOL_FORMATS, ToolFormat
from jaxrl_llm.envs.tools import Tool, call_tool
from jaxrl_llm.errors import ConfigError


def opening_messages(record: dict[str, Any], prompt_field: str) -> list[Message]:
    """The record's prompt as the conversation's opening: its messages, or one user message."""
    prompt = record.get(prompt_field, "")
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


@register_environment("tool_use")
class ToolUseEnvironment:
    """A task the model may solve with `tools` (see the module docstring); at most `max_calls` calls a turn, written
    in `tool_format` (a name of `TOOL_FORMATS`, or a `ToolFormat`, e.g. one `with_response_parsing` gave; the
    trainer passes `env.tool_format` resolved)."""

    def __init__(self, record: dict[str, Any], *, tools: list[Tool] | tuple[Tool, ...] = (),
                 prompt_field: str = "prompt", max_calls: int = 4, tool_format: str | ToolFormat = "hermes") -> None:
        self.record, self.prompt_field, self.max_calls = record, prompt_field, max_calls
        self.tools = {t.name: t for t in tools}
        if not isinstance(tool_format, ToolFormat) and tool_format not in TOOL_FORMATS:
            raise ConfigError(f"tool_format={tool_format!r}: one of {', '.join(TOOL_FORMATS)}")
        self.format = tool_format if isinstance(tool_format, ToolFormat) else TOOL_FORMATS[tool_format]

    def reset(self) -> list[Message]:
        return opening_messages(self.record, self.prompt_field)

    def step(self, assistant_text: str) -> StepResult:
        calls, errors = self.format.parse(assistant_text, {name: t.parameters for name, t in self.tools.items()})
        if not calls and not errors:
            return StepResult([], 0.0, True, {"tool_calls": 0, "tool_errors": 0})
        messages, failed = [self.format.result(f"error: {e}") for e in errors], len(errors)
        for call in calls[: self.max_calls]:
            observation, ok = call_tool(self.tools, call)
            messages.append(self.format.result(observation, call))
            failed += not ok
        if len(calls) > self.max_calls:
            messages.append(self.format.result(f"error: at most {self.max_calls} tool calls a turn"))
            failed += len(calls) - self.max_calls
        return StepResult(messages, 0.0, False, {"tool_calls": len(calls) + len(errors), "tool_errors": failed})


@register_environment("single_turn")
class SingleTurnEnvironment:
    """The prompt and one reply: the one-turn case of a multi-turn rollout."""

    def __init__(self, record: dict[str, Any], *, prompt_field: str = "prompt", **unused: Any) -> None:
        self.record, self.prompt_field = record, prompt_field

    def reset(self) -> list[Message]:
        return opening_messages(self.record, self.prompt_field)

    def step(self, assistant_text: str) -> StepResult:
        return StepResult([], 0.0, True, {})
