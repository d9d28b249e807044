"""Tiny runs of the CLI's config and the readers of their files: the arguments of a tiny quiet run, the run
directory's rows, the paths of ../shared (and the skip when it is absent), reward functions that runs name as
`tests.runs:<name>`, and a refused config's one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "configs"

SHARED = Path(__file__).resolve().parents[2] / "shared"

STORIES260K = SHARED / "models" / "stories260K"

GSM8K = SHARED / "data" / "gsm8k"


def requires_shared(path: Path) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not path.exists(), reason=f"{path} is absent (a clone without ../shared); real-checkpoint test skipped"
    )


# The one shape of a tiny run: a rollout of 4 prompts x 4 samples, 16 held-out problems scored in one batch,
# few steps. Tests that do not depend on these values keep them, so each compiled program (sampler, update,
# evaluation) is compiled once and then served by the persistent compile cache to every other file.
TINY_SHAPE = ("steps=1", "rl.prompts_per_step=4", "rl.group_size=4", "eval_size=16", "eval_batch_size=16")

# Nothing a test does not look at: no progress bar, TensorBoard events, export or HTML report.
QUIET = ("progress_bar=false", "tensorboard=false", "export=false", "report=false")


def tiny_run_args(out: Path, *overrides: str, task: Path | None = None) -> list[str]:
    """`key=value` arguments (for `train.py`, `train.cli` or `load_run_config`) of a tiny quiet run into `out`:
    `task`'s model, train and held-out data when given (the `tiny_task` fixture's layout), TINY_SHAPE, QUIET,
    then `overrides`, which win (e.g. `data.eval=` for no held-out set, `export=true`)."""
    data = [] if task is None else [f"model.path={task / 'model'}", f"data.train={task / 'train.jsonl'}",
                                    f"data.eval={task / 'test.jsonl'}"]
    return [*data, f"out_dir={out}", *TINY_SHAPE, *QUIET, *overrides]


def tiny_run(preset: str | None, out: Path, *overrides: str, task: Path | None = None, **kwargs):
    """The RunConfig of a tiny run of `configs/<preset>` (None: the built-in defaults) into `out`, with
    `tiny_run_args`; `kwargs` (algo=, rewards=) go to `load_run_config`."""
    from jaxrl_llm.config import load_run_config

    path = None if preset is None else CONFIGS / (preset if preset.endswith(".yaml") else f"{preset}.yaml")
    return load_run_config(path, tiny_run_args(out, *overrides, task=task), **kwargs)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_rows(run: Path, having: str | None = None) -> list[dict]:
    """The rows of `run/metrics.jsonl`; with `having`, only those that log that metric (e.g. "reward/mean": the
    training steps, not the evaluation-only rows)."""
    return [r for r in _jsonl(run / "metrics.jsonl") if having is None or having in r]


def read_samples(run: Path) -> list[dict]:
    """The rows of `run/samples.jsonl`."""
    return _jsonl(run / "samples.jsonl")


def read_summary(run: Path) -> dict:
    """`run/summary.json`."""
    return json.loads((run / "summary.json").read_text())


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def completion_length(prompts, completions, **fields):
    """A reward that differs within a group of a random model's completions (the tiny model rarely adds
    right, so math_answer alone can leave every group at 0 and the policy unmoved): their length / 8."""
    return [len(c) / 8 for c in completions]


def starts_with_seven(prompts, completions, **fields):
    """A trivially learnable reward: the completion starts with the digit 7."""
    return [float(c.startswith("7")) for c in completions]


def assert_config_refused(overrides: list[str], match: str) -> None:
    """Loading a config with these command-line `overrides` fails with a `ConfigError` whose line matches `match`."""
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.preflight import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
