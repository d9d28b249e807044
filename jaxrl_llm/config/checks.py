"""The checks every run's config passes when it is loaded: each field's allowed values (its metadata: `fields.py`),
then the relations between fields that every run shares. An algorithm's own relations are its `validate`
(`jaxrl_llm.trainers`); what needs the outside world is `jaxrl_llm.preflight`."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl_llm.config.schema import RunConfig
from jaxrl_llm.errors import ConfigError


def _fields(obj: Any, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """`(dotted key, value, field)` of every leaf field of the config `obj`, reward specs as rewards.I.NAME."""
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(_fields(value, f"{key}."))
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                out.extend(_fields(item, f"{key}.{i}."))
        else:
            out.append((key, value, f))
    return out


def check_fields(c: RunConfig) -> None:
    """Every field's allowed values (its metadata), then the relations every run shares; one-line `ConfigError`."""
    for key, value, f in _fields(c):
        if "range" in f.metadata and (error := f.metadata["range"].error(key, value)):
            raise ConfigError(error)
        if "choices" in f.metadata and value not in f.metadata["choices"]:
            raise ConfigError(f"{key}={value!r}: expected one of {', '.join(f.metadata['choices'])}")
    sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert, c.mesh.sequence)
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"mesh.data/fsdp/tensor/expert/sequence={sizes}: each is a positive size, and at most one "
                          "is -1")
    if c.lora.rank:
        try:
            re.compile(c.lora.targets)
        except re.error as e:
            raise ConfigError(f"lora.targets={c.lora.targets!r} is not a regular expression: {e}") from e
    if not c.out_dir.strip():
        raise ConfigError("out_dir='': a run needs an output directory (e.g. runs/my_run)")


def get_field(c: Any, key: str) -> Any:
    """The value of the dotted `key` ("rl.beta") in the config `c`."""
    for part in key.split("."):
        c = getattr(c, part)
    return c
