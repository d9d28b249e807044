"""The tool-call formats against the real chat templates of their families (tests/fixtures/chat_templates, with
their origins): a conversation with calls rendered by the template, the assistant's part cut out and parsed back,
gives the same calls; a malformed call is an error observation; `auto` picks each template's format; and the
tool_use environment parses and answers in the configured format, rendered as the template expects. With the
response templates TRL attaches to these families (response_templates.json), the calls come through transformers'
`parse_response` and equal ours; SmolLM2, which has none, keeps ours."""

from __future__ import annotations

import inspect
import json
import string
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from jaxrl_llm.config import ConfigError, load_run_config
from jaxrl_llm.config.schema import TOOL_FORMAT_NAMES
from jaxrl_llm.envs.base import resolve_environment
from jaxrl_llm.envs.rendering import declare_tools, followup_text, resolve_tool_format, turn_text
from jaxrl_llm.envs.tool_formats import TOOL_FORMATS, ToolCall, detect_tool_format, with_response_parsing
from jaxrl_llm.envs.tools import CALCULATOR, tool_instructions
from tests.runs import ROOT

pytestmark = pytest.mark.quick
FIXTURES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
# fixture -> (the format it renders calls in, the end of an assistant turn, calls per turn it allows)
TEMPLATES = {
    "qwen2.5_instruct.jinja": ("hermes", "<|im_end|>", 3),
    "qwen3_8b.jinja": ("hermes", "<|im_end|>", 3),
    "llama3.1_8b_instruct.jinja": ("llama3_json", "<|eot_id|>", 1),  # "This model only supports single tool-calls"
    "mistral_7b_instruct_v0.3.jinja": ("mistral", "</s>", 3),
    "ministral_3_14b_instruct_2512.jinja": ("mistral", "</s>", 3),
    "qwen3.5_35b_a3b.jinja": ("qwen3_xml", "<|im_end|>", 3),
}
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                            "where": {"type": "object"}, "note": {"type": ["string", "null"]}}}
SCHEMAS = {"calculator": CALCULATOR.parameters, "weather": WEATHER}


def template(name: str) -> str:
    return (FIXTURES / name).read_text()


def render(source: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
           generation: bool = False) -> str:
    """The template's text of `messages`, as `apply_chat_template(..., tokenize=False)` renders it."""
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=source,
                                        add_generation_prompt=generation, **TOKENS)
    return rendered[0]


def declaration(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


def model_text(name: str, calls: list[ToolCall]) -> str:
    """What the model writes for `calls` as its family's template renders them: the assistant's part of the
    conversation, cut at the end of its turn."""
    source, end = template(name), TEMPLATES[name][1]
    opening = [{"role": "user", "content": "What is 347 * 812?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": c.id or f"call{i:05d}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)]}
    tools = [declaration(n, p) for n, p in {**SCHEMAS, **{c.name: WEATHER for c in calls}}.items()]
    prompt, full = render(source, opening, tools, generation=True), render(source, [*opening, turn], tools)
    assert full.startswith(prompt)
    return full[len(prompt):].split(end)[0]


class TemplateTokenizer:
    """A tokenizer's chat side without its vocabulary: `apply_chat_template` renders the fixture's Jinja."""

    def __init__(self, source: str, eos_token: str) -> None:
        self.chat_template, self.eos_token = source, eos_token

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: Any = None) -> str:
        return render(self.chat_template, messages, tools, generation=add_generation_prompt)


def tokenizer_of(name: str) -> TemplateTokenizer:
    return TemplateTokenizer(template(name), TEMPLATES[name][1])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_calls_rendered_by_the_real_template_parse_back(name: str) -> None:
    fmt = TOOL_FORMATS[TEMPLATES[name][0]]
    calls = [ToolCall("calculator", {"expression": "347 * 812"}, "a1B2c3D4e"),
             ToolCall("weather", {"city": " São Paulo\n", "days": 3, "metric": True, "hours": [6, 12],
                                  "where": {"lat": 48.85, "country": "FR"}, "note": None}, "Z9y8X7w6v"),
             ToolCall("calculator", {"expression": "2 ** 10"}, "q1w2e3r4t")][: TEMPLATES[name][2]]
    text = model_text(name, calls)
    parsed, errors = fmt.parse(text, SCHEMAS)
    assert errors == []
    assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls], text
    if name.startswith("mistral_7b"):  # v3 tokenizers' calls carry their ids, and the results answer them
        assert [c.id for c in parsed] == [c.id for c in calls]
        assert [fmt.result("x", c)["tool_call_id"] for c in parsed] == [c.id for c in calls]
    for other in sorted(set(TOOL_FORMATS) - {fmt.name}):  # the mismatch: another family's parser finds no calls
        assert TOOL_FORMATS[other].parse(text, SCHEMAS)[0] == [], f"{other} parses {fmt.name}'s calls"


NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)
TEXT = st.text(string.ascii_letters + string.digits + " \n\t.,:;!?'\"{}[]()*/+-=_#%&@\\|~^$", max_size=30)
VALUES = st.one_of(TEXT, st.integers(-10**12, 10**12), st.booleans(), st.none(),
                   st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.lists(st.integers(-99, 99), max_size=4), st.dictionaries(NAMES, TEXT, max_size=3))
KINDS = {str: "string", int: "integer", bool: "boolean", type(None): "null", float: "number", list: "array",
         dict: "object"}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(TEMPLATES)), st.lists(st.tuples(NAMES, st.dictionaries(NAMES, VALUES, max_size=5)),
                                                   min_size=1, max_size=3))
def test_random_calls_round_trip_through_every_template(name: str, drawn: list[tuple[str, dict[str, Any]]]) -> None:
    drawn = drawn[: TEMPLATES[name][2]]
    calls = [ToolCall(n, a, f"{i}abcdefgh") for i, (n, a) in enumerate(drawn)]
    schemas: dict[str, dict[str, Any]] = {}  # each tool's arguments, typed as first drawn (qwen3_xml reads them)
    for n, a in drawn:
        properties = schemas.setdefault(n, {"type": "object", "properties": {}})["properties"]
        for k, v in a.items():
            properties.setdefault(k, {"type": KINDS[type(v)]})
    calls = [c for c in calls if all(schemas[c.name]["properties"][k]["type"] == KINDS[type(v)]
                                     for k, v in c.arguments.items())]
    if not calls:
        return
    text = model_text(name, calls)
    parsed, errors = TOOL_FORMATS[TEMPLATES[name][0]].parse(text, schemas)
    assert errors == [] and [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments) for c in calls]


MALFORMED = {
    "hermes": ['<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>',
               '<tool_call>{"arguments": {"expression": "1"}}</tool_call>'],
    "llama3_json": ['{"name": "calculator", "parameters": {"expression": "1"}',
                    '<|python_tag|>calculator.call(expression="1")', '{"parameters": {"expression": "1"}}'],
    "mistral": ['[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1"}',
                '[TOOL_CALLS]calculator[ARGS]{"expression": ', "[TOOL_CALLS]calculator 2*3",
                '[TOOL_CALLS][{"name": "calculator", "arguments": 7}]'],
    "qwen3_xml": ["<tool_call>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
                  "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</tool_call>"],
}


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_a_malformed_call_is_one_error_and_an_answer_is_no_call(fmt: str) -> None:
    for text in MALFORMED[fmt]:
        calls, errors = TOOL_FORMATS[fmt].parse(text, SCHEMAS)
        assert calls == [] and len(errors) == 1 and errors[0], text
    for answer in ("The answer is 281764.", "347 * 812 = 281764", "Sure: [1, 2] and {3}"):
        assert TOOL_FORMATS[fmt].parse(answer, SCHEMAS) == ([], [])


def test_the_hermes_format_is_todays_parser() -> None:
    text = 'a <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call> <tool_call>x'
    calls, errors = TOOL_FORMATS["hermes"].parse(text + "</tool_call>", None)
    assert calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert errors == ["the tool call is not valid JSON (Expecting value); write "
                      '<tool_call>{"name": ..., "arguments": {...}}</tool_call>']
    assert TOOL_FORMATS["hermes"].result("6", calls[0]) == {"role": "tool", "name": "calculator", "content": "6"}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_auto_picks_each_templates_format(name: str) -> None:
    assert detect_tool_format(template(name)) == TEMPLATES[name][0]
    fmt, why = resolve_tool_format("auto", tokenizer_of(name), chat=True)
    assert (fmt.name, why) == (TEMPLATES[name][0], "auto: from the chat template")
    assert resolve_tool_format("auto", tokenizer_of(name), chat=False)[0].name == "hermes"  # no chat template used
    assert resolve_tool_format("mistral", tokenizer_of(name), chat=True)[0].name == "mistral"  # named: as named


def test_auto_falls_back_to_hermes_with_the_instructions_for_smollm2_and_says_when_it_cannot_tell() -> None:
    smollm2 = TemplateTokenizer(template("smollm2_135m_instruct.jinja"), "<|im_end|>")
    assert detect_tool_format(smollm2.chat_template) is None
    assert resolve_tool_format("auto", smollm2, chat=True) == (TOOL_FORMATS["hermes"],
                                                               "auto: no chat template with tool support")
    unknown = TemplateTokenizer("{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}", "")
    fmt, why = resolve_tool_format("auto", unknown, chat=True)
    assert fmt.name == "hermes" and "not recognized; set env.tool_format" in why


def test_the_calculator_recipe_keeps_hermes_and_its_instructions() -> None:
    recipe = ROOT / "configs" / "grpo_smollm2_tool_calculator.yaml"
    assert "tool_format" not in yaml.safe_load(recipe.read_text())["env"]
    config = load_run_config(str(recipe), [])
    smollm2 = TemplateTokenizer(template("smollm2_135m_instruct.jinja"), "<|im_end|>")
    fmt, _ = resolve_tool_format(config.env.tool_format, smollm2, chat=config.data.chat_template)
    assert fmt.name == "hermes" and fmt.markers == ()  # a turn decodes as before (skip_special_tokens=True)
    assert with_response_parsing(fmt, smollm2, chat=config.data.chat_template)[0] is fmt  # no response template
    schemas, data = declare_tools([CALCULATOR], config.data, smollm2, fmt)
    assert schemas is None and data.system_prompt.startswith(tool_instructions([CALCULATOR]))
    assert ('You can use tools. To call one, reply with only\n<tool_call>{"name": "TOOL", "arguments": {...}}'
            "</tool_call>\nIts result comes back") in data.system_prompt  # the SFT warm start's system message


def test_env_tool_format_is_checked_by_name() -> None:
    assert set(TOOL_FORMAT_NAMES) == {"auto", *TOOL_FORMATS}
    with pytest.raises(ConfigError, match=r"^env.tool_format='xml': expected one of auto, hermes, llama3_json"):
        load_run_config(None, ["env.tool_format=xml"])
    with pytest.raises(ConfigError, match="tool_format='auto'"):  # the environment takes a resolved format
        resolve_environment("tool_use")({"prompt": "x"}, tools=[CALCULATOR], tool_format="auto")


@pytest.mark.parametrize(("name", "expected"), [
    ("llama3.1_8b_instruct.jinja",
     '<|start_header_id|>ipython<|end_header_id|>\n\n"281764"<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
     "\n\n"),
    ("mistral_7b_instruct_v0.3.jinja", '[TOOL_RESULTS] {"content": 281764, "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'),
    ("ministral_3_14b_instruct_2512.jinja", "[TOOL_RESULTS]281764[/TOOL_RESULTS]"),
    ("qwen3.5_35b_a3b.jinja",
     "\n<|im_start|>user\n<tool_response>\n281764\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"),
    ("qwen2.5_instruct.jinja",
     "\n<|im_start|>user\n<tool_response>\n281764\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
])
def test_the_tool_use_environment_calls_and_answers_in_the_configured_format(name: str, expected: str) -> None:
    fmt, _ = resolve_tool_format("auto", tokenizer_of(name), chat=True)
    env = resolve_environment("tool_use")({"prompt": "What is 347 * 812?"}, tools=[CALCULATOR], tool_format=fmt.name)
    text = model_text(name, [ToolCall("calculator", {"expression": "347 * 812"}, "a1B2c3D4e")])
    result = env.step(text)
    assert not result.done and result.info == {"tool_calls": 1, "tool_errors": 0}
    assert [m["content"] for m in result.messages] == ["281764"]
    assert followup_text(tokenizer_of(name), result.messages, chat=True) == expected
    if fmt.name != "hermes":  # the mismatch: a model taught another format, parsed as hermes, never calls a tool
        hermes = resolve_environment("tool_use")({"prompt": "x"}, tools=[CALCULATOR], tool_format="hermes")
        mismatch = hermes.step(text)
        assert mismatch.info["tool_errors"] == mismatch.info["tool_calls"]  # none, or only errors
        assert "281764" not in str(mismatch.messages)


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_bad_calls_keep_todays_error_observations_in_every_format(fmt: str) -> None:
    calls = {"hermes": '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
             "llama3_json": '{"name": "weather", "parameters": {"city": "Paris"}}',
             "mistral": '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}]',
             "qwen3_xml": "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                          "</tool_call>"}
    env = resolve_environment("tool_use")({"prompt": "x"}, tools=[CALCULATOR], tool_format=fmt, max_calls=1)
    result = env.step(calls[fmt] + "\n" + MALFORMED[fmt][0])
    assert [m["content"] for m in result.messages][-1] == "error: unknown tool 'weather' (available: calculator)"
    assert result.messages[0]["content"].startswith("error: ") and result.info == {"tool_calls": 2, "tool_errors": 2}
    assert all(m["role"] == "tool" for m in result.messages)
    if fmt == "mistral":  # every result names a call, as Mistral's templates require
        assert all(len(m["tool_call_id"]) == 9 and m["tool_call_id"].isalnum() for m in result.messages)


class MarkerTokenizer:
    """Ids 0-9 are digits, 10 is a special [TOOL_CALLS], 11 a special end of turn."""

    SPECIAL = {10: "[TOOL_CALLS]", 11: "</s>"}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return {v: k for k, v in self.SPECIAL.items()}.get(token)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.SPECIAL.get(i, str(i))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.SPECIAL[i] if i in self.SPECIAL else str(i) for i in ids
                       if not (skip_special_tokens and i in self.SPECIAL))


def test_a_turn_keeps_the_special_tokens_its_format_reads() -> None:
    tokenizer, ids = MarkerTokenizer(), [1, 10, 2, 3, 11]
    assert turn_text(tokenizer, ids) == "123"  # as before: without special tokens
    assert turn_text(tokenizer, ids, TOOL_FORMATS["mistral"].markers) == "1[TOOL_CALLS]23"
    assert turn_text(tokenizer, ids, TOOL_FORMATS["llama3_json"].markers) == "123"  # not in this vocabulary


# The response templates TRL's `add_response_schema` (trl 1.16.0) attaches to these families (response_templates.json):
# Qwen2.5 and Qwen3 -> qwen3, Qwen3.5 -> qwen3_5, Llama 3.1 -> llama3. Mistral's have none.
RESPONSE_TEMPLATES = json.loads((FIXTURES / "response_templates.json").read_text())
RESPONSE = {"qwen2.5_instruct.jinja": "qwen3", "qwen3_8b.jinja": "qwen3", "llama3.1_8b_instruct.jinja": "llama3",
            "qwen3.5_35b_a3b.jinja": "qwen3_5"}
SMOLLM2_HF = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "hf"
needs_response_templates = pytest.mark.skipif(
    "tools" not in inspect.signature(PreTrainedTokenizerBase.parse_response).parameters,
    reason="transformers < 5.15: parse_response reads no response_template, or types no arguments")


class ParsingTokenizer(TemplateTokenizer):
    """A fixture's template with a response template attached as TRL does (`tokenizer.response_template = ...`),
    parsed by transformers' own `PreTrainedTokenizerBase.parse_response`; `parsed` and `raised` count its answers."""

    def __init__(self, source: str, eos_token: str, response_template: dict[str, Any]) -> None:
        super().__init__(source, eos_token)
        self.response_template, self.parsed, self.raised = response_template, 0, 0

    def parse_response(self, response: str, schema: Any = None, *, prefix: Any = None, tools: Any = None) -> Any:
        try:
            message = PreTrainedTokenizerBase.parse_response(self, response, schema, prefix=prefix, tools=tools)
        except Exception:
            self.raised += 1
            raise
        self.parsed += 1
        return message


def parsing_tokenizer(name: str) -> ParsingTokenizer:
    return ParsingTokenizer(template(name), TEMPLATES[name][1], RESPONSE_TEMPLATES[RESPONSE[name]])


def response_format(name: str) -> tuple[Any, ParsingTokenizer]:
    tokenizer = parsing_tokenizer(name)
    fmt, why = with_response_parsing(TOOL_FORMATS[TEMPLATES[name][0]], tokenizer)
    assert (fmt.parser, why) == ("parse_response", "the tokenizer's response_template")
    return fmt, tokenizer


@needs_response_templates
@pytest.mark.parametrize("name", sorted(RESPONSE))
def test_parse_response_gives_the_calls_the_real_template_renders_as_ours_does(name: str) -> None:
    fmt, tokenizer = response_format(name)
    ours = TOOL_FORMATS[TEMPLATES[name][0]]
    city = "São Paulo, SP" if ours.name == "qwen3_xml" else " São Paulo\n"  # qwen3_xml: see the test below
    calls = [ToolCall("calculator", {"expression": "347 * 812"}),
             ToolCall("weather", {"city": city, "days": 3, "metric": True, "hours": [6, 12],
                                  "where": {"lat": 48.85, "country": "FR"}, "note": None}),
             ToolCall("calculator", {"expression": "2 ** 10"})][: TEMPLATES[name][2]]
    text = model_text(name, calls)
    parsed = fmt.parse(text, SCHEMAS)
    assert (tokenizer.parsed, tokenizer.raised) == (1, 0)  # parse_response read it
    assert parsed == (calls, []), text
    assert parsed == ours.parse(text, SCHEMAS)
    assert fmt.result("6", parsed[0][0]) == ours.result("6", parsed[0][0])  # results as before


@needs_response_templates
def test_qwen3_xml_string_values_lose_their_edge_whitespace_through_parse_response() -> None:
    """TRL's qwen3_5 template reads a value as `\\s*(.*?)\\s*`; ours drops only the newline the template adds."""
    fmt, tokenizer = response_format("qwen3.5_35b_a3b.jinja")
    text = model_text("qwen3.5_35b_a3b.jinja", [ToolCall("weather", {"city": " São Paulo\n", "days": 3})])
    assert fmt.parse(text, SCHEMAS) == ([ToolCall("weather", {"city": "São Paulo", "days": 3})], [])
    assert TOOL_FORMATS["qwen3_xml"].parse(text, SCHEMAS) == ([ToolCall("weather", {"city": " São Paulo\n",
                                                                                     "days": 3})], [])


@needs_response_templates
def test_parse_response_decides_a_call_in_qwen3s_reasoning_is_no_call() -> None:
    fmt, tokenizer = response_format("qwen3_8b.jinja")
    text = ('<think>\nMaybe <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            "\n</think>\n\nThe answer is 6.")
    assert fmt.parse(text, SCHEMAS) == ([], []) and tokenizer.parsed == 1
    assert TOOL_FORMATS["hermes"].parse(text, SCHEMAS) == ([ToolCall("calculator", {"expression": "2*3"})], [])


@needs_response_templates
@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(RESPONSE)), st.lists(st.tuples(NAMES, st.dictionaries(NAMES, VALUES, max_size=5)),
                                                  min_size=1, max_size=3))
def test_random_calls_round_trip_through_parse_response(name: str, drawn: list[tuple[str, dict[str, Any]]]) -> None:
    drawn = drawn[: TEMPLATES[name][2]]
    schemas: dict[str, dict[str, Any]] = {}
    for n, a in drawn:
        properties = schemas.setdefault(n, {"type": "object", "properties": {}})["properties"]
        for k, v in a.items():
            properties.setdefault(k, {"type": KINDS[type(v)]})
    calls = [ToolCall(n, a) for n, a in drawn if all(schemas[n]["properties"][k]["type"] == KINDS[type(v)]
                                                     for k, v in a.items())]
    if not calls:
        return
    fmt, tokenizer = response_format(name)
    text = model_text(name, calls)
    xml = fmt.name == "qwen3_xml"  # its values lose their edge whitespace (the test above)
    expected = [ToolCall(c.name, {k: v.strip() if xml and isinstance(v, str) else v for k, v in c.arguments.items()})
                for c in calls]
    assert fmt.parse(text, schemas) == (expected, []) and (tokenizer.parsed, tokenizer.raised) == (1, 0)


@needs_response_templates
@pytest.mark.parametrize("name", ["qwen2.5_instruct.jinja", "llama3.1_8b_instruct.jinja", "qwen3.5_35b_a3b.jinja"])
def test_a_malformed_call_keeps_our_error_observation_and_a_reply_parse_response_cannot_read_is_ours(name: str
                                                                                                      ) -> None:
    fmt, tokenizer = response_format(name)
    ours = TOOL_FORMATS[TEMPLATES[name][0]]
    for text in MALFORMED[ours.name]:
        calls, errors = fmt.parse(text, SCHEMAS)
        assert (calls, errors) == ours.parse(text, SCHEMAS) and calls == [] and len(errors) == 1, text
    for answer in ("The answer is 281764.", "347 * 812 = 281764", "Sure: [1, 2] and {3}"):
        assert fmt.parse(answer, SCHEMAS) == ([], [])
    if ours.name == "qwen3_xml":  # xml-inline never raises; a call cut off at the turn's end is still read
        cut = "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n"
        assert fmt.parse(cut, SCHEMAS) == ([ToolCall("calculator", {"expression": "1"})], [])
        assert ours.parse(cut, SCHEMAS) == ([], [])
        return
    raising = {"hermes": '<tool_call>{"name": "calculator", "arguments": {"expression": "1"',  # cut off: no call
               "llama3_json": '{"name": "calculator", "parameters": {"expression": "1"}}\n'}  # not `}<|eot_id|>`
    before = tokenizer.raised
    assert fmt.parse(raising[ours.name], SCHEMAS) == ours.parse(raising[ours.name], SCHEMAS)
    assert tokenizer.raised == before + 1
    assert fmt.parse(raising[ours.name], SCHEMAS)[0] == (
        [ToolCall("calculator", {"expression": "1"})] if ours.name == "llama3_json" else [])


@needs_response_templates
@pytest.mark.parametrize("name", sorted(RESPONSE))
def test_the_tool_use_environment_answers_alike_through_parse_response(name: str) -> None:
    fmt, _ = response_format(name)
    good = model_text(name, [ToolCall("calculator", {"expression": "347 * 812"})])
    for text in (good, MALFORMED[fmt.name][0], good + "\n" + MALFORMED[fmt.name][0]):
        results = [resolve_environment("tool_use")({"prompt": "x"}, tools=[CALCULATOR], tool_format=f).step(text)
                   for f in (fmt, fmt.name)]
        assert results[0] == results[1], text
    assert results[0].messages[0]["content"].startswith("error: ")  # the malformed call's observation, as ours


def test_which_parser_a_tokenizer_gets_and_why() -> None:
    qwen3, hermes = parsing_tokenizer("qwen3_8b.jinja"), TOOL_FORMATS["hermes"]
    assert with_response_parsing(hermes, qwen3, chat=False) == (hermes, "ours: no chat template")
    assert with_response_parsing(TOOL_FORMATS["qwen3_xml"], qwen3) == (
        TOOL_FORMATS["qwen3_xml"], "ours: the tokenizer's response_template reads hermes calls, not qwen3_xml")
    assert with_response_parsing(TOOL_FORMATS["llama3_json"], qwen3)[0].parser == "ours"
    assert with_response_parsing(TOOL_FORMATS["qwen3_xml"], parsing_tokenizer("qwen3.5_35b_a3b.jinja"))[0].parser \
        == "parse_response"
    no_calls = ParsingTokenizer(qwen3.chat_template, "<|im_end|>", {
        **RESPONSE_TEMPLATES["qwen3"], "fields": {"content": RESPONSE_TEMPLATES["qwen3"]["fields"]["content"]}})
    assert with_response_parsing(hermes, no_calls) == (hermes, "ours: the tokenizer's response_template reads no "
                                                               "tool calls")
    for mistral in ("mistral_7b_instruct_v0.3.jinja", "ministral_3_14b_instruct_2512.jinja"):  # no template known
        assert with_response_parsing(TOOL_FORMATS["mistral"], tokenizer_of(mistral)) == (
            TOOL_FORMATS["mistral"], "ours: the tokenizer has no response_template")


@needs_response_templates
def test_a_family_none_of_ours_reads_is_parsed_by_its_response_template() -> None:
    """A template whose calls are none of our formats' (Gemma 4's, gpt-oss's): its calls are still found."""
    calls = {"open": "<|call|>", "close": "<|/call|>", "repeats": True, "content": "json",
             "transform": {"type": "function", "function": "{content}"}}
    tokenizer = ParsingTokenizer("", "<eos>", {"start_anchor": "<model>", "fields": {"tool_calls": calls,
                                                                                     "content": {"content": "text"}}})
    fmt, _ = with_response_parsing(TOOL_FORMATS["hermes"], tokenizer)
    text = 'Let me compute. <|call|>{"name": "calculator", "arguments": {"expression": "2*3"}}<|/call|>'
    assert fmt.parser == "parse_response"
    assert fmt.parse(text, SCHEMAS) == ([ToolCall("calculator", {"expression": "2*3"})], [])
    assert fmt.parse('<|call|>{"arguments": {}}<|/call|>', SCHEMAS) == (
        [], ['a tool call needs "name" (a string) and "arguments" (an object)'])


def test_smollm2_has_no_response_template_and_keeps_our_parser() -> None:
    smollm2 = TemplateTokenizer(template("smollm2_135m_instruct.jinja"), "<|im_end|>")
    hermes = TOOL_FORMATS["hermes"]
    fmt, why = with_response_parsing(hermes, smollm2)
    assert fmt is hermes and fmt.parser == "ours" and why == "ours: the tokenizer has no response_template"
    if SMOLLM2_HF.exists():  # the checkpoint's own tokenizer (../shared): none shipped either
        from transformers import AutoTokenizer

        real = AutoTokenizer.from_pretrained(str(SMOLLM2_HF))
        assert getattr(real, "response_template", None) is None
        assert with_response_parsing(hermes, real) == (hermes, "ours: the tokenizer has no response_template")
