"""How an environment's messages and tools reach the model's text, and a turn's text the environment: the chat
template's text between a model's turn and the next (`followup_text`), the tools' declarations (`declare_tools`: the
template's own, or a plain-text convention in the system prompt), the tool-call format (`resolve_tool_format`) and
the text of a turn (`turn_text`: its ids decoded, keeping the format's special tokens).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxrl_llm.config import DataSection
from jaxrl_llm.envs.base import Message
from jaxrl_llm.envs.tool_formats import HERMES, TOOL_FORMATS, ToolFormat, detect_tool_format
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


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry or added token, as
    stored: a byte-level token's string is never shorter than its text), so `n` tokens never hold more than `n`
    times this many characters. Cached on the tokenizer."""
    cached = getattr(tokenizer, "_jaxrl_longest_token_chars", None)
    if cached is None:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        cached = max(1, *(len(p) for p in pieces if p))
        try:
            tokenizer._jaxrl_longest_token_chars = cached
        except AttributeError:  # a tokenizer object that takes no new attributes: recomputed next time
            pass
    return int(cached)


def exceeds_budget(tokenizer: Any, messages: list[Message], tokens: int) -> bool:
    """Whether `messages` surely take more than `tokens` tokens, decided from their lengths alone (their contents hold
    more characters than `tokens` tokens can): a huge environment reply is then never rendered or tokenized. False
    says nothing: render and count them."""
    limit = tokens * longest_token_chars(tokenizer)
    return sum(len(str(m.get("content") or "")) for m in messages) > limit


def declare_tools(tools: list[Tool], data: DataSection, tokenizer: Any, tool_format: ToolFormat = HERMES
                  ) -> tuple[list[dict[str, Any]] | None, DataSection]:
    """How the tools reach the model: their JSON schemas for a chat template that renders them (else None), and the
    data settings whose system prompt carries the plain-text convention (`tool_instructions`) otherwise."""
    native = bool(tools) and data.chat_template and template_supports_tools(tokenizer)
    extra = tool_instructions(tools, tool_format) if tools and not native else ""
    joiner = "\n\n" if data.chat_template else "\n"
    system = joiner.join(s for s in (extra, data.system_prompt) if s)
    return ([t.schema for t in tools] if native else None), dataclasses.replace(data, system_prompt=system)


def resolve_tool_format(name: str, tokenizer: Any, *, chat: bool) -> tuple[ToolFormat, str]:
    """`env.tool_format` as a format, and why: `auto` is the format the chat template renders calls in; hermes
    (with the plain-text instructions) when there is no template or it has no tool support, or when its format
    is not one of ours (the note says so: set env.tool_format)."""
    if name != "auto":
        return TOOL_FORMATS[name], "env.tool_format"
    if not chat or not template_supports_tools(tokenizer):
        return HERMES, "auto: no chat template with tool support"
    template = tokenizer.chat_template
    detected = detect_tool_format(template if isinstance(template, str) else json.dumps(template))
    if detected is None:
        return HERMES, "auto: the chat template's tool-call format is not recognized; set env.tool_format"
    return TOOL_FORMATS[detected], "auto: from the chat template"


def turn_text(tokenizer: Any, ids: list[int], keep: tuple[str, ...] = ()) -> str:
    """A model's turn as text: `ids` decoded without special tokens, except the special tokens in `keep` (a tool
    format's markers, e.g. Mistral's [TOOL_CALLS]), which stay as written."""
    marks = {i: t for t in keep if (i := tokenizer.convert_tokens_to_ids(t)) is not None
             and tokenizer.convert_ids_to_tokens(i) == t}
    if not marks:
        return tokenizer.decode(ids, skip_special_tokens=True)
    parts, start = [], 0
    for k, i in enumerate(ids):
        if i in marks:
            parts += [tokenizer.decode(ids[start:k], skip_special_tokens=True), marks[i]]
            start = k + 1
    return "".join(parts) + tokenizer.decode(ids[start:], skip_special_tokens=True)
