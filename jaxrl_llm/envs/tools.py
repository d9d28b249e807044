"""Tool calling: tools declared as JSON schemas, calls parsed from the model's text, results as tool messages.

    <tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>

is the default call format (Hermes / Qwen2.5's); `tool_formats.py` has the other families' (`env.tool_format`).
A template that supports tools gets the schemas through `apply_chat_template(..., tools=[...])`; one that does not
(SmolLM2's, or no template) gets the documented plain-text convention: `tool_instructions(tools)` is a system
message that lists the schemas and asks for the format's calls. Either way the model's text is parsed by the
format and a result comes back as a `{"role": "tool"}` message. A bad call (not JSON, an unknown tool, wrong
arguments, a tool that raises or times out) is answered with an error observation the model can read; it never
stops the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from typing import Any

from jaxrl_llm.envs.calculator import CalculatorError, calculate
from jaxrl_llm.envs.deadlines import DeadlineExceeded, DeadlineWorkers, HungCalls
from jaxrl_llm.envs.sandbox import run_python
from jaxrl_llm.envs.tool_formats import HERMES, ToolCall, ToolFormat
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.registry import import_named

MAX_RESULT_CHARS = 2000  # a tool's answer is cut to this many characters before the model reads it
# Every tool call of the process runs here: as many at once as a run's environment steps usually make (each waits
# on its tool), and at most 64 abandoned calls alive before a tool answers "unavailable".
TOOL_WORKERS = DeadlineWorkers(16, "jaxrl_llm-tool", max_hung=64)


class ToolError(Exception):
    """A call the model made wrong: the message is what the model reads back."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, its arguments as a JSON schema, and `fn(**args)
    -> str` (a `ToolError` or any exception becomes an error observation)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]
    timeout_s: float = 10.0

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style declaration chat templates render (`tools=[...]`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def call_tool(tools: dict[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """`(observation, ok)` of one call: the tool's answer, or an error the model can read. The tool runs on
    `TOOL_WORKERS`, so one that hangs past its `timeout_s` is abandoned, not waited for (envs/deadlines.py)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r} (available: {', '.join(sorted(tools))})", False
    required = tool.parameters.get("required", [])
    known = tool.parameters.get("properties", {})
    missing, unknown = [a for a in required if a not in call.arguments], [a for a in call.arguments if a not in known]
    if missing or unknown:
        return f"error: {call.name} takes {', '.join(known)}; got {', '.join(call.arguments) or 'nothing'}", False
    pending = TOOL_WORKERS.submit(functools.partial(tool.fn, **call.arguments),
                                  deadline=time.monotonic() + tool.timeout_s)
    try:
        return str(TOOL_WORKERS.result(pending))[:MAX_RESULT_CHARS], True
    except HungCalls:
        return f"error: {call.name} is unavailable (earlier calls to tools still hang)", False
    except DeadlineExceeded:
        return f"error: {call.name} took longer than {tool.timeout_s:g} s", False
    except Exception as e:  # a tool that raises is the model's observation, never the run's crash
        return f"error: {' '.join(str(e).split())[:300] or type(e).__name__}", False


def tool_instructions(tools: list[Tool], tool_format: ToolFormat = HERMES) -> str:
    """The plain-text convention for a chat template without tool support: a system message that declares the
    tools (one line each: `name(argument: type, ...): description`) and the format's calls."""
    lines = []
    for t in tools:
        arguments = ", ".join(f"{name}: {spec.get('type', 'any')}"
                              for name, spec in t.parameters.get("properties", {}).items())
        lines.append(f"- {t.name}({arguments}): {t.description}")
    return ("You can use tools. To call one, reply with only\n"
            + tool_format.example + "\n"
            "Its result comes back in the next message. To answer, reply without a tool call.\nTools:\n"
            + "\n".join(lines))


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list (Qwen2.5, Llama 3.1, ...)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def _calculator(expression: str) -> str:
    try:
        return calculate(expression)
    except CalculatorError as e:
        raise ToolError(str(e)) from None


def _python(code: str) -> str:
    return run_python(code, timeout_s=5.0).observation()


CALCULATOR = Tool("calculator", "Exact arithmetic: + - * / // % ** and parentheses on integers and decimals.",
                  {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. 1234 * 5678"}},
                   "required": ["expression"]}, _calculator)
PYTHON = Tool("python", "Run a Python program in a sandbox (no network, 5 s) and return what it prints.",
              {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
               "required": ["code"]}, _python, timeout_s=15.0)
TOOLS: dict[str, Tool] = {t.name: t for t in (CALCULATOR, PYTHON)}


def resolve_tools(names: list[str]) -> list[Tool]:
    """The built-in tools named (`calculator`, `python`), or a `module:attribute` holding a `Tool`."""
    out = []
    for name in names:
        if name in TOOLS:
            out.append(TOOLS[name])
            continue
        tool = import_named(name, "env.tools") if ":" in name else None
        if not isinstance(tool, Tool):
            raise ConfigError(f"env.tools: {name!r} is not a built-in tool ({', '.join(TOOLS)}) or a "
                              f"module:attribute holding a jaxrl_llm.envs.tools.Tool")
        out.append(tool)
    return out
