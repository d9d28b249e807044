"""How an environment's messages and tools reach the model's text: the chat template's text between a model's
turn and the next (`followup_text`), and the tools' declarations (`declare_tools`: the template's own, or a
plain-text convention in the system prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.config import DataSection
from jaxrl_llm.envs.base import Message
from jaxrl_llm.envs.tools import Tool, template_supports_tools, tool_instructions

TEXT_TOOL_RESULT = "\n<tool_response>\n{content}\n</tool_response>\n"  # a tool's answer without a chat template


def followup_text(tokenizer: Any, messages: list[Message], *, chat: bool) -> str:
    """The text that follows a model's turn (which ended with its EOS token) when `messages` come next: what the
    chat template renders after the assistant's end-of-turn, through the next assistant header; without a chat
    template, each message's content (a tool's wrapped in <tool_response>)."""
    if not chat:
        return "".join(TEXT_TOOL_RESULT.format(content=m["content"]) if m["role"] == "tool" else m["content"]
                       for m in messages)
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token or ""
    end = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
    return before[end:] + after[len(before):]  # e.g. "\n" + "<|im_start|>tool\n...<|im_end|>\n<|im_start|>assistant\n"


def declare_tools(tools: list[Tool], data: DataSection, tokenizer: Any
                  ) -> tuple[list[dict[str, Any]] | None, DataSection]:
    """How the tools reach the model: their JSON schemas for a chat template that renders them (else None), and the
    data settings whose system prompt carries the plain-text convention (`tool_instructions`) otherwise."""
    native = bool(tools) and data.chat_template and template_supports_tools(tokenizer)
    extra = tool_instructions(tools) if tools and not native else ""
    joiner = "\n\n" if data.chat_template else "\n"
    system = joiner.join(s for s in (extra, data.system_prompt) if s)
    return ([t.schema for t in tools] if native else None), dataclasses.replace(data, system_prompt=system)
