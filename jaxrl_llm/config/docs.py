"""The config's documentation, read from the dataclasses themselves: `--print-config` and `docs/config-reference.md`.

Each field's help is its comment in `jaxrl_llm/config/schema.py` (the inline `# ...`, or the comment lines right
above it; a section's is its class docstring), so the code and the docs cannot drift apart:

    python train.py --print-config [--algo X] [--config FILE] [overrides]   the resolved config, commented
    python -m jaxrl_llm.config.docs --write                                  regenerate docs/config-reference.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxrl_llm.config import RewardSpec, RunConfig

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """`{field: help}` of a config dataclass, from the comments of its source (one line each)."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}  # line number -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.STRING):
            code_lines.add(tok.start[0])
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    for number, line in enumerate(source.splitlines(), start=1):
        name = line.strip().split(":", 1)[0]
        if not line.startswith("    ") or line.startswith("     ") or name not in names or name in docs:
            continue
        if number in comments:
            docs[name] = comments[number]
            continue
        above, k = [], number - 1
        while k in comments and k not in code_lines:
            above.insert(0, comments[k])
            k -= 1
        if above:
            docs[name] = " ".join(above)
    for f in dataclasses.fields(cls):  # a field of a fixed list whose comment does not name every choice names them
        choices = f.metadata.get("choices", ())
        text = docs.get(f.name, "")
        if choices and not all(choice in text for choice in choices):
            docs[f.name] = f"{text}; one of {', '.join(choices)}" if text else f"one of {', '.join(choices)}"
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # a section without a comment: its class docstring's first sentence
        section = hints[f.name]
        if f.name not in docs and dataclasses.is_dataclass(section) and _docstring(section):
            docs[f.name] = _docstring(section).split(". ")[0].rstrip(".")
    return docs


def _docstring(cls: type) -> str:
    """The class docstring on one line; "" for the signature dataclasses write when there is none."""
    doc = " ".join((cls.__doc__ or "").split())
    return "" if doc.startswith(cls.__name__ + "(") else doc


def _sections(cls: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _comment(text: str) -> str:
    return f"  # {text}" if text else ""


def commented_yaml(config: RunConfig) -> str:
    """`config` as YAML with each field's help as a trailing comment; loads back to the same config."""
    lines = [f"# The resolved config; relative paths in it are relative to {Path.cwd()}"]

    def emit(obj: Any, cls: type, indent: str) -> None:
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            value, help_text = getattr(obj, f.name), docs.get(f.name, "")
            if dataclasses.is_dataclass(hints[f.name]):
                lines.append(f"{indent}{f.name}:{_comment(help_text)}")
                emit(value, hints[f.name], indent + "  ")
            elif f.name == "rewards" and value:
                lines.append(f"{indent}{f.name}:{_comment(help_text)}")
                spec_docs = field_docs(RewardSpec)
                for spec in value:
                    for i, sf in enumerate(dataclasses.fields(RewardSpec)):
                        lead = "- " if i == 0 else "  "
                        lines.append(f"{indent}  {lead}{sf.name}: {_scalar(getattr(spec, sf.name))}"
                                     f"{_comment(spec_docs.get(sf.name, ''))}")
            else:
                lines.append(f"{indent}{f.name}: {_scalar(value)}{_comment(help_text)}")

    emit(config, RunConfig, "")
    return "\n".join(lines) + "\n"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "").replace("jaxrl_llm.config.", "")
    return tp.__name__


def markdown() -> str:
    """docs/config-reference.md: every field with its type, default and help, section by section."""
    out = ["# Configuration reference", "",
           "Generated from `jaxrl_llm/config/schema.py` by `python -m jaxrl_llm.config.docs --write`; a test checks it "
           "is current. Set a field in a YAML file (`section:` then `field: value`) or on the command line "
           "(`section.field=value`). `python train.py --print-config [--config FILE] [overrides]` prints the "
           "resolved config of a run with these comments.", "",
           "Relative paths (`model.path`, `data.train`, `data.eval`, `out_dir`, `export_dir`, ...) in a YAML file "
           "are relative to that file's folder; on the command line, to the current folder. A reward "
           "`module:function` imports from the YAML file's folder and the current folder without PYTHONPATH.", ""]
    defaults = RunConfig()

    def table(title: str, cls: type, obj: Any, prefix: str) -> None:
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        rows = [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
        if not rows:
            return
        out.extend([f"## {title}", ""])
        if _docstring(cls):
            out.extend([_docstring(cls), ""])
        out.extend(["| key | type | default | what it is |", "| --- | --- | --- | --- |"])
        for f in rows:
            default = _scalar(getattr(obj, f.name)).replace("|", "\\|")
            help_text = docs.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{default}` | {help_text} |")
        out.append("")

    table("Top level", RunConfig, defaults, "")
    out.extend(["Each entry of `rewards` is:", ""])
    table("rewards[]", RewardSpec, RewardSpec(), "rewards[].")
    def sections(cls: type, obj: Any, prefix: str) -> None:  # nested sections (rl.loss) after their parent
        for name, sub in _sections(cls):
            table(f"{prefix}{name}:", sub, getattr(obj, name), f"{prefix}{name}.")
            sections(sub, getattr(obj, name), f"{prefix}{name}.")

    sections(RunConfig, defaults, "")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxrl_llm.config.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {DOCS_PATH} (default: print it)")
    args = parser.parse_args(argv)
    text = markdown()
    if args.write:
        DOCS_PATH.write_text(text)
        print(f"wrote {DOCS_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
