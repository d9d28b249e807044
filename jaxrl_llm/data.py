"""Prompt datasets: JSONL or Hugging Face datasets -> rendered, tokenized, length-filtered prompts; batching.

A record is a dict with a prompt (text, or chat messages `[{"role", "content"}]` rendered with the
tokenizer's chat template) and any other fields (answers...), which reach reward functions as keywords.
Prompts longer than `max_prompt_tokens` are dropped and counted, never cut. The batch order is a pure
function of `(seed, epoch, position)`, so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.config import DataSection
from jaxrl_llm.errors import ConversionError, DataError


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; blank lines are skipped, anything else must be a JSON object."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    records = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from e
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    if not records:
        raise DataError(f"{path}: the file has no records (one JSON object per line expected)")
    return records


# Datasets handed over in Python (`jaxrl_llm.train(train_dataset=...)`), named `python:NAME` in the config.
PYTHON_DATASETS: dict[str, list[dict[str, Any]]] = {}


def register_dataset(name: str, dataset: Any) -> str:
    """Keep an in-memory dataset (a list of dicts, or a `datasets.Dataset`) as the source `python:NAME`."""
    records = [dict(r) if hasattr(r, "keys") else r for r in dataset]
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{name}[{i}]: expected a dict (a record with a prompt), got {type(record).__name__}")
    if not records:
        raise DataError(f"{name}: the dataset is empty")
    PYTHON_DATASETS[name] = records
    return f"python:{name}"


def load_records(source: str, split: str = "train") -> tuple[list[dict[str, Any]], str]:
    """Records from a JSONL path, `hf:NAME[:CONFIG]` (a hub dataset through `datasets`) or `python:NAME` (a
    registered in-memory dataset), and a label for error messages."""
    if source.startswith("python:"):
        if source[7:] not in PYTHON_DATASETS:
            raise DataError(f"{source}: no such in-memory dataset (pass it to jaxrl_llm.train again)")
        return PYTHON_DATASETS[source[7:]], source[7:]
    if source.startswith("hf:"):
        import datasets

        name, _, subset = source[3:].partition(":")
        try:
            dataset = datasets.load_dataset(name, subset or None, split=split)
        except Exception as e:  # offline, unknown name or split: say which dataset, one line
            raise DataError(f"hub dataset {source} (split {split!r}) cannot be loaded: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from e
        return [dict(r) for r in dataset], f"{name}[{split}]"
    return read_jsonl(source), source


def _fill(template: str, record: dict[str, Any], where: str) -> str:
    try:
        return template.format(**record)
    except KeyError as e:
        raise DataError(f"{where}: template {template!r} needs field {e.args[0]!r}, record has {sorted(record)}") from e


@dataclasses.dataclass
class PromptSet:
    """Tokenized prompts that fit, with their records (all fields) and rendered text."""

    token_ids: list[list[int]]
    texts: list[str]
    records: list[dict[str, Any]]
    num_dropped: int

    def __len__(self) -> int:
        return len(self.token_ids)


def encode_text(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """The token ids of `text`, without transformers' "Token indices sequence length is longer than the specified
    maximum sequence length for this model" warning: it concerns the tokenizer's model_max_length, which is not
    a limit here (prompts are held to data.max_prompt_tokens, and those dropped are counted)."""
    return list(tokenizer(text, verbose=False, **kwargs)["input_ids"])


def build_prompt_set(records: Sequence[dict[str, Any]], label: str, cfg: DataSection, tokenizer: Any) -> PromptSet:
    """Render each record's prompt (template / chat template), tokenize it and drop those that do not fit."""
    token_ids, texts, kept = [], [], []
    dropped = 0
    for i, record in enumerate(records, start=1):
        where = f"{label}:{i}"
        record = dict(record)
        if cfg.prompt_template:
            record[cfg.prompt_field] = _fill(cfg.prompt_template, record, where)
        if cfg.answer_template:
            record[cfg.answer_field] = _fill(cfg.answer_template, record, where)
        if cfg.prompt_field not in record:
            raise DataError(f"{where}: no {cfg.prompt_field!r} field (fields: {sorted(record)})")
        text, ids = render_prompt(record[cfg.prompt_field], cfg, tokenizer, where)
        if len(ids) > cfg.max_prompt_tokens:
            dropped += 1
            continue
        token_ids.append(list(ids))
        texts.append(text)
        kept.append(record)
    if not token_ids:
        raise DataError(f"{label}: no prompt fits data.max_prompt_tokens={cfg.max_prompt_tokens} ({dropped} dropped)")
    return PromptSet(token_ids, texts, kept, dropped)


def render_prompt(prompt: Any, cfg: DataSection, tokenizer: Any, where: str,
                  tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """`(text, token ids)` of a prompt (text, or chat messages): through the chat template with the system prompt
    (and `tools`, the JSON schemas of the tools, for a template that renders them), or as text after
    `data.system_prompt`. A multi-turn episode's opening goes through here too, so its tokens are a single-turn
    prompt's."""
    if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise DataError(f"{where}: chat prompt must be a list of {{'role', 'content'}} messages")
    messages = _chat_messages(prompt, cfg)
    if messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{where}: chat prompt given but the tokenizer has no chat template")
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return text, encode_text(tokenizer, text, add_special_tokens=False)
    if isinstance(prompt, str):
        text = cfg.system_prompt + prompt
        return text, encode_text(tokenizer, text)
    raise DataError(f"{where}: {cfg.prompt_field!r} must be text or chat messages, got {type(prompt).__name__}")


def _chat_messages(prompt: Any, cfg: DataSection) -> list[dict[str, Any]] | None:
    """The chat messages a prompt is rendered from (with the system prompt), or None for a text prompt."""
    if not (isinstance(prompt, list) or cfg.chat_template):
        return None
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


def response_text(value: Any, where: str, name: str) -> str:
    """A preference response: text, or chat messages (TRL's conversational format) whose last turn is it."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return str(value[-1]["content"])
    raise DataError(f"{where}: {name!r} must be text or chat messages [{{'role', 'content'}}], "
                    f"got {type(value).__name__}")


def _check_pair_fields(records: Sequence[dict[str, Any]], label: str, cfg: DataSection) -> None:
    for i, r in enumerate(records, start=1):
        missing = [f for f in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field) if f not in r]
        if missing:
            raise DataError(f"{label}:{i}: preference record lacks {missing} (fields: {sorted(r)})")


def pair_texts(records: Sequence[dict[str, Any]], label: str, cfg: DataSection,
               tokenizer: Any) -> list[tuple[str, ...]]:
    """`(prompt + chosen, prompt + rejected)` as whole texts, what a reward model scores: with chat messages (or
    `data.chat_template`), each response rendered as the assistant turn of the tokenizer's chat template."""
    _check_pair_fields(records, label, cfg)
    out = []
    for i, r in enumerate(records, start=1):
        where = f"{label}:{i}"
        messages = _chat_messages(r[cfg.prompt_field], cfg)
        sides = [response_text(r[f], where, f) for f in (cfg.chosen_field, cfg.rejected_field)]
        if messages is None:
            out.append((str(r[cfg.prompt_field]) + sides[0], str(r[cfg.prompt_field]) + sides[1]))
            continue
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{where}: chat prompt given but the tokenizer has no chat template")
        out.append(tuple(tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": text}],
                                                       tokenize=False) for text in sides))
    return out


@dataclasses.dataclass
class PreferenceSet:
    """Preference pairs for a policy: each prompt tokenized as the policy sees it (`build_prompt_set`), each
    response as the completion it would sample (`response + EOS`); pairs that do not fit are dropped."""

    prompt_ids: list[list[int]]
    chosen_ids: list[list[int]]
    rejected_ids: list[list[int]]
    records: list[dict[str, Any]]
    num_dropped: int

    def __len__(self) -> int:
        return len(self.prompt_ids)


def build_preference_set(records: Sequence[dict[str, Any]], label: str, cfg: DataSection, tokenizer: Any,
                         eos_id: int, max_response_tokens: int) -> PreferenceSet:
    """Prompts rendered and tokenized like the policy's (template, chat template, system prompt), responses as
    `tokens(response) + [eos_id]`; pairs whose prompt exceeds `data.max_prompt_tokens` or a response
    `max_response_tokens` are dropped and counted."""
    _check_pair_fields(records, label, cfg)
    for i, r in enumerate(records, start=1):
        for f in (cfg.chosen_field, cfg.rejected_field):
            response_text(r[f], f"{label}:{i}", f)
    prompts = build_prompt_set(records, label, cfg, tokenizer)
    out = PreferenceSet([], [], [], [], prompts.num_dropped)
    for ids, record in zip(prompts.token_ids, prompts.records, strict=True):
        sides = [encode_text(tokenizer, response_text(record[f], label, f), add_special_tokens=False) + [eos_id]
                 for f in (cfg.chosen_field, cfg.rejected_field)]
        if max(map(len, sides)) > max_response_tokens:
            out.num_dropped += 1
            continue
        out.prompt_ids.append(ids)
        out.chosen_ids.append(sides[0])
        out.rejected_ids.append(sides[1])
        out.records.append(record)
    if not out.prompt_ids:
        raise DataError(f"{label}: no preference pair fits data.max_prompt_tokens / sampling.max_new_tokens "
                        f"({out.num_dropped} dropped)")
    return out


def left_pad(sequences: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokens, mask [B, length]` int32 with each sequence right-aligned (left padding)."""
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence of {len(seq)} tokens does not fit length {length}")
        if len(seq):
            tokens[i, length - len(seq) :] = seq
            mask[i, length - len(seq) :] = 1
    return tokens, mask


@dataclasses.dataclass(frozen=True)
class DataState:
    """Where the prompt stream is: epoch and position inside that epoch's permutation."""

    epoch: int = 0
    position: int = 0


def next_batch_indices(num_records: int, batch_size: int, state: DataState, seed: int, shuffle: bool = True
                       ) -> tuple[np.ndarray, DataState]:
    """Indices of the next `batch_size` prompts and the new state (epochs wrap, each reshuffled by seed)."""
    out: list[int] = []
    epoch, position = state.epoch, state.position
    while len(out) < batch_size:
        order = (np.random.default_rng([seed, epoch]).permutation(num_records) if shuffle
                 else np.arange(num_records))
        take = order[position : position + batch_size - len(out)]
        out.extend(take.tolist())
        position += len(take)
        if position >= num_records:
            epoch, position = epoch + 1, 0
    return np.asarray(out, np.int64), DataState(epoch, position)


def bucket(n: int, multiple: int = 16) -> int:
    """`n` rounded up to a multiple (at least one), so padded shapes repeat and jitted code is reused."""
    return max(multiple, -(-n // multiple) * multiple)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer_files(model_dir: str | Path) -> None:
    """A clear error for a model directory without a tokenizer (transformers' own is a misleading hint)."""
    if Path(model_dir).is_dir() and not any((Path(model_dir) / n).is_file() for n in TOKENIZER_FILES):
        raise ConversionError(f"{model_dir} has no tokenizer files (any of {', '.join(TOKENIZER_FILES)}); copy "
                              f"the tokenizer that belongs to this model into it (tokenizer.save_pretrained(DIR))")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's tokenizer, left-padding, with a pad token (unk, else EOS) when it defines none."""
    from transformers import AutoTokenizer

    check_tokenizer_files(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def eos_token_ids(model_dir: str | Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (a list is allowed), else the tokenizer's."""
    gen = Path(model_dir) / "generation_config.json"
    ids: Any = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
    if ids is None:
        ids = tokenizer.eos_token_id
    return tuple(int(i) for i in ids) if isinstance(ids, list) else (int(ids),)
