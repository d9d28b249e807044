"""A model directory's tokenizer, as the sampler and the trainers use it: left padding, a pad token, and the ids
that end a completion (generation_config.json's EOS list, else the tokenizer's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxrl_llm.errors import ConversionError

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
