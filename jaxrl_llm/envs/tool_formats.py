"""Tool-call formats: how a model family writes a call in its text, and how the call's result goes back to it.

    hermes       <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>
                 Qwen2.5, Qwen3, Hermes
    llama3_json  {"name": "calculator", "parameters": {"expression": "2*3"}}   (after an optional <|python_tag|>;
                 several joined by ";")   Llama 3.1, 3.2
    mistral      [TOOL_CALLS] [{"name": "calculator", "arguments": {...}, "id": "a1b2c3d4e"}]
                 Mistral 7B v0.3, Small 3.1 (v3 tokenizers)
                 [TOOL_CALLS]calculator[ARGS]{"expression": "2*3"}   Ministral 3, Devstral 2 (newer tokenizers)
    qwen3_xml    <tool_call>\\n<function=calculator>\\n<parameter=expression>\\n2*3\\n</parameter>\\n</function>\\n
                 </tool_call>   Qwen3-Coder, Qwen3.5

`parse(text, schemas)` gives the well-formed calls and one error message per malformed call (the model reads it
back as an error observation); `schemas` (tool name -> its parameters' JSON schema) types qwen3_xml's values, which
the text carries untyped. `result(content, call)` is the message that answers a call the way the family's chat
template renders it: `{"role": "tool", "name", "content"}` (Llama's template renders it under its `ipython`
header), and for Mistral also `tool_call_id`, 9 alphanumeric characters (the call's own id, else one made from
the call). `markers` are the special tokens a parser reads, kept when a turn's ids are decoded.

`env.tool_format: auto` picks by the chat template's source (`detect_tool_format`): the first of `<function=`
(qwen3_xml), `<tool_call>` (hermes), `[TOOL_CALLS]` (mistral), `<|python_tag|>` or `ipython` (llama3_json).

Where the tokenizer has a response template (`tokenizer.response_template`, which transformers >= 5.13 reads;
checkpoints ship it, TRL's `add_response_schema` attaches the known ones), `with_response_parsing` gives the format
whose calls come from `tokenizer.parse_response` (`parser == "parse_response"`); our parsers stay the fallback
(`parser == "ours"`): for a tokenizer without one (SmolLM2), a text it cannot parse, and every malformed call, whose
error observations stay ours.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_llm.config.schema import TOOL_FORMAT_NAMES

Message = dict[str, Any]
Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> the JSON schema of its arguments
Parsed = tuple[list["ToolCall"], list[str]]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call parsed from the model's text: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]
    id: str = ""  # the id the model wrote with the call (Mistral's), else ""


def _call(data: Any, key: str, call_id: Any = "") -> ToolCall | str:
    """`{"name": str, key: object or a JSON string of one}` as a call ("arguments" also stands for `key`), else the
    error message."""
    data = data if isinstance(data, dict) else {}
    name, arguments = data.get("name"), data.get(key, data.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return f'a tool call needs "name" (a string) and "{key}" (an object)'
    return ToolCall(name, arguments, call_id if isinstance(call_id, str) else "")


def _collect(items: list[ToolCall | str]) -> Parsed:
    return [c for c in items if isinstance(c, ToolCall)], [e for e in items if isinstance(e, str)]


def _json_objects(text: str, key: str, hint: str) -> list[ToolCall | str]:
    """The JSON values that start `text`, one after another (separated by whitespace or ";"): each a call (a list
    holds several); text after them is ignored, a value that does not decode is one error."""
    items: list[ToolCall | str] = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text) and text[pos] in "{[":
        try:
            data, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return [*items, f"the tool call is not valid JSON ({e.msg}); write {hint}"]
        items += [_call(d, key, d.get("id", "") if isinstance(d, dict) else "")
                  for d in (data if isinstance(data, list) else [data])]
        while pos < len(text) and text[pos] in " \t\n;":
            pos += 1
    return items


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str, schemas: Schemas | None = None) -> Parsed:
    """Each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block."""
    items: list[ToolCall | str] = []
    for block in HERMES_CALL.findall(text):
        try:
            items.append(_call(json.loads(block), "arguments"))
        except json.JSONDecodeError as e:
            items.append(f"the tool call is not valid JSON ({e.msg}); write "
                         f'<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>')
    return _collect(items)


def parse_llama3_json(text: str, schemas: Schemas | None = None) -> Parsed:
    """A turn that is JSON calls `{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>`; a
    turn that starts otherwise is an answer."""
    hint = '{"name": ..., "parameters": {...}}'
    body = text.strip()
    tagged, body = body.startswith("<|python_tag|>"), body.removeprefix("<|python_tag|>").lstrip()
    if not tagged and not body.startswith("{"):
        return [], []
    return _collect(_json_objects(body, "parameters", hint) or [f"no tool call after <|python_tag|>; write {hint}"])


MISTRAL_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?(?:\[ARGS\])?\s*(?=\{)")


def parse_mistral(text: str, schemas: Schemas | None = None) -> Parsed:
    """What follows each `[TOOL_CALLS]`: a JSON list of `{"name", "arguments", "id"?}` (v3 tokenizers), or
    `NAME[ARGS]{...}` (also `NAME[CALL_ID]ID[ARGS]{...}` and `NAME{...}`) of the newer ones."""
    hint = '[TOOL_CALLS][{"name": ..., "arguments": {...}}] or [TOOL_CALLS]NAME[ARGS]{...}'
    items: list[ToolCall | str] = []
    for part in text.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        named = MISTRAL_NAMED.match(part)
        if part.startswith(("[", "{")):
            items += _json_objects(part, "arguments", hint)
        elif named is None:
            items.append(f"the tool call is not NAME[ARGS]{{...}}; write {hint}")
        else:
            try:
                arguments = json.JSONDecoder().raw_decode(part, named.end())[0]
            except json.JSONDecodeError as e:
                items.append(f"the tool call is not valid JSON ({e.msg}); write {hint}")
                continue
            items.append(_call({"name": named.group(1), "arguments": arguments}, "arguments", named.group(2) or ""))
    return _collect(items)


XML_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # what Jinja's `| string` makes of them


def parse_qwen3_xml(text: str, schemas: Schemas | None = None) -> Parsed:
    """Each `<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function></tool_call>` block; a value
    is typed by the tool's schema (a string stays as written; numbers, booleans, objects and arrays are decoded)."""
    items: list[ToolCall | str] = []
    for block in XML_CALL.findall(text):
        function = XML_FUNCTION.match(block)
        if function is None:
            items.append("the tool call is not <function=NAME>...</function>; write <tool_call>\\n<function=NAME>"
                         "\\n<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>")
            continue
        name = function.group(1).strip()
        properties = (schemas or {}).get(name, {}).get("properties", {})
        arguments = {key.strip(): _typed(value.removeprefix("\n").removesuffix("\n"), properties.get(key.strip()))
                     for key, value in XML_PARAMETER.findall(function.group(2))}
        items.append(ToolCall(name, arguments))
    return _collect(items)


def _typed(value: str, spec: Mapping[str, Any] | None) -> Any:
    """A qwen3_xml value as its schema's type: a string as written (also without a schema; None or null when the
    type admits null), else its JSON (or Python literal) value, or the text when it is neither."""
    kind = (spec or {}).get("type", "string")
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds and value.strip() in ("None", "null"):
        return None
    if "string" in kinds:
        return value
    if value.strip() in PYTHON_LITERALS:
        return PYTHON_LITERALS[value.strip()]
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One family's tool calls (see the module docstring)."""

    name: str
    parse: Callable[[str, Schemas | None], Parsed]
    example: str  # a call of TOOL as the model writes it: the plain-text instructions show it
    markers: tuple[str, ...] = ()  # the special tokens `parse` reads: kept when a turn is decoded
    call_ids: bool = False  # a result names its call by `tool_call_id` (Mistral's templates require it)
    parser: str = "ours"  # what `parse` runs: "ours", or "parse_response" (`with_response_parsing`)

    def result(self, content: str, call: ToolCall | None = None) -> Message:
        """The message that answers `call` (None: a call that could not be parsed) with `content`."""
        message: Message = {"role": "tool", "content": content}
        if call is not None:
            message["name"] = call.name
        if self.call_ids:
            message["tool_call_id"] = (call.id if call is not None and re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
                                       else call_id(call, content))
        return message


def call_id(call: ToolCall | None, content: str) -> str:
    """A 9-character alphanumeric id made from the call (or the error's text): the same call, the same id."""
    seed = json.dumps([call.name, call.arguments] if call is not None else content, sort_keys=True, default=str)
    return hashlib.sha1(seed.encode()).hexdigest()[:9]


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", parse_hermes, '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'),
    ToolFormat("llama3_json", parse_llama3_json, '{"name": "TOOL", "parameters": {...}}',
               markers=("<|python_tag|>",)),
    ToolFormat("mistral", parse_mistral, '[TOOL_CALLS][{"name": "TOOL", "arguments": {...}}]',
               markers=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), call_ids=True),
    ToolFormat("qwen3_xml", parse_qwen3_xml,
               "<tool_call>\n<function=TOOL>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>"),
)}
HERMES = TOOL_FORMATS["hermes"]
assert set(TOOL_FORMATS) | {"auto"} == set(TOOL_FORMAT_NAMES), "env.tool_format's choices (config/schema.py)"

# `auto`: the first marker found in the chat template's source names its format.
TEMPLATE_MARKERS = (("<function=", "qwen3_xml"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                    ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def detect_tool_format(template: str) -> str | None:
    """The format a chat template's source renders tool calls in, or None when none of the markers is in it."""
    return next((name for marker, name in TEMPLATE_MARKERS if marker in template), None)


# `with_response_parsing`: the first marker found in a response template's tool-call patterns names the format it
# reads ('"parameters"' is Llama's JSON key); a template with none of them (Gemma 4's, gpt-oss's) is no mismatch.
RESPONSE_MARKERS = (("<function=", "qwen3_xml"), ("<tool_call>", "hermes"), ("TOOL_CALLS", "mistral"),
                    ('"parameters"', "llama3_json"), ("python_tag", "llama3_json"))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    return [s for item in items for s in _strings(item)]


def with_response_parsing(fmt: ToolFormat, tokenizer: Any, *, chat: bool = True) -> tuple[ToolFormat, str]:
    """`fmt` with its calls parsed by `tokenizer.parse_response` when the tokenizer has a response template that reads
    tool calls (and the conversation is rendered by its chat template), else `fmt` itself; and which parser, and
    why, for the run's header. A template whose tool-call patterns are another of our formats' (a Qwen3 tokenizer
    with `env.tool_format: qwen3_xml`) keeps ours."""
    template = getattr(tokenizer, "response_template", None)
    parse_response = getattr(tokenizer, "parse_response", None)
    if not chat:
        return fmt, "ours: no chat template"
    if template is None or not callable(parse_response):
        legacy = " (a legacy response_schema is not read)" if getattr(tokenizer, "response_schema", None) else ""
        return fmt, f"ours: the tokenizer has no response_template{legacy}"
    fields = template.get("fields", {}) if isinstance(template, Mapping) else {}
    if "tool_calls" not in fields:
        return fmt, "ours: the tokenizer's response_template reads no tool calls"
    patterns = "\n".join(_strings(fields["tool_calls"]))
    reads = next((name for marker, name in RESPONSE_MARKERS if marker in patterns), None)
    if reads is not None and reads != fmt.name:
        return fmt, f"ours: the tokenizer's response_template reads {reads} calls, not {fmt.name}"
    try:
        takes = inspect.signature(parse_response).parameters
    except (TypeError, ValueError):
        takes = {}
    if "prefix" not in takes:
        return fmt, "ours: this transformers' parse_response reads no response_template (it needs >= 5.13)"
    parse = ResponseParsing(tokenizer, fmt.parse, "tools" in takes)
    return dataclasses.replace(fmt, parse=parse, parser="parse_response"), "the tokenizer's response_template"


@dataclasses.dataclass(frozen=True, eq=False)
class ResponseParsing:
    """A format's `parse` through `tokenizer.parse_response`: its tool calls as `ToolCall`s. Our parser (`fallback`)
    answers instead when it finds a malformed call (its error observations are the format's) and when
    `parse_response` raises (a call it cannot read); the tokenizer's EOS token, which the decoded turn drops, closes
    the text (Llama's template ends a call with it)."""

    tokenizer: Any
    fallback: Callable[[str, Schemas | None], Parsed]
    typed: bool = True  # `parse_response` takes `tools=` (transformers >= 5.15): the schemas type the arguments

    def __call__(self, text: str, schemas: Schemas | None = None) -> Parsed:
        ours = self.fallback(text, schemas)
        if ours[1]:
            return ours
        eos = getattr(self.tokenizer, "eos_token", None)
        eos = eos if isinstance(eos, str) else ""
        tools = [{"type": "function", "function": {"name": name, "parameters": dict(parameters)}}
                 for name, parameters in (schemas or {}).items()]
        try:
            message = self.tokenizer.parse_response(text if text.endswith(eos) else text + eos, prefix="",
                                                    **({"tools": tools} if self.typed and tools else {}))
        except Exception:  # a reply it cannot read is ours to answer, never the end of the run
            return ours
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        calls = [calls] if isinstance(calls, dict) else calls if isinstance(calls, list) else []
        return _collect([_call(c.get("function", c) if isinstance(c, dict) else c, "arguments",
                               c.get("id", "") if isinstance(c, dict) else "") for c in calls])
