"""What the task data commands share: their command line (output folder, split sizes, seed) and JSONL writing."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxrl_llm.cli.errors import CommandParser


def split_parser(prog: str, description: str, *, out: str, train: int, test: int, seed: int) -> CommandParser:
    """A task data command's parser with `--out`, `--train`, `--test`, `--seed` (the task adds its own options)."""
    parser = CommandParser(prog=prog, description=description)
    parser.add_argument("--out", default=out)
    parser.add_argument("--train", type=int, default=train)
    parser.add_argument("--test", type=int, default=test)
    parser.add_argument("--seed", type=int, default=seed)
    return parser


def parse_split_args(parser: CommandParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, refusing an empty train split or a negative test split."""
    args = parser.parse_args(argv)
    if args.train < 1 or args.test < 0:
        parser.error(f"--train {args.train} must be >= 1 and --test {args.test} >= 0")
    return args


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object a line."""
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
