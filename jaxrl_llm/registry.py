"""Names a config gives for code: the one place a `module:attribute` string becomes an object.

Losses, advantage estimators, rewards, environments, tools and algorithms are named in a run's config either by a
built-in name or as `module:attribute` (a module on the path, or beside the config file). `import_named` imports one;
`resolve_name` looks a name up in a registry and registers what it imports. Every failure is one line naming the
config key.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jaxrl_llm.errors import ConfigError


def import_named(name: str, key: str, error: type[Exception] = ConfigError) -> Any:
    """The attribute `attr` of module `module` for `name = "module:attr"`, or `error` (one line naming `key`) when
    it cannot be imported or has no such attribute."""
    module_name, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise error(f"{key}={name!r} cannot be imported: {e}") from e


def resolve_name(key: str, name: str, registry: dict[str, Any], register: Callable[[str, Any], None],
                 doc: str = "docs/extending.md") -> str:
    """`name` if in `registry`; a `module:function` is imported and added with `register(name, fn)`; else a
    one-line `ConfigError` naming `key` (and the page `doc` that says how to write one)."""
    if name in registry:
        return name
    if ":" not in name:
        raise ConfigError(f"{key}={name!r}: expected one of {', '.join(registry)}, or 'module:function' (see {doc})")
    register(name, import_named(name, key))
    return name
