"""What the task data writers share: JSONL writing."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object a line."""
    with path.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
