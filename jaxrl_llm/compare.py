"""Blind comparison of several models (e.g. SFT, an early RL checkpoint, the final one) on the same prompts.

    python -m jaxrl_llm.compare --models A B C --prompts FILE [--out DIR] [--limit N] [--chat]
        [--max-new-tokens N] [--greedy | --temperature T] [--seed S] [--judge REWARD_OR_REWARD_MODEL_DIR]
    python -m jaxrl_llm.compare --reveal VOTES.csv --key DIR/key.json

Each model (a HF directory, RUN_DIR or RUN_DIR:STEP) answers every prompt (greedy by default). The blind sheet
shows each prompt's answers under the labels A, B, C, ... with the models shuffled per prompt (a permutation
drawn per prompt from `--seed`); the key is a separate file:

    DIR/sheet.html, DIR/sheet.csv    prompt_id, prompt, label, response (for the raters)
    DIR/votes.csv                    prompt_id, preferred: a template to fill with the preferred label
    DIR/key.json                     per prompt, label -> model (keep it from the raters)

`--judge` scores every response with a reward function (a built-in, module:function, or the directory of a
reward model) and prints, for each pair of models, the win rate of the first over the second,

    win_rate(i, j) = mean over prompts of o_p,  o_p = 1 if s_i > s_j, 1/2 if s_i == s_j, else 0

with a 95% interval mean +- 1.96 * std(o) / sqrt(P) (clipped to [0, 1]). `--reveal` joins the filled votes
with the key and prints each model's share of the votes (same interval).
"""

from __future__ import annotations

import argparse
import csv
import html
import itertools
import json
import math
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.cli import CommandParser, run_command
from jaxrl_llm.errors import DataError, UsageError

LABELS = string.ascii_uppercase


def blind_assignment(num_prompts: int, num_models: int, seed: int) -> list[list[int]]:
    """For each prompt, the model index shown under label A, B, ...: a permutation of the models drawn from
    `default_rng(seed)` per prompt."""
    if num_models > len(LABELS):
        raise UsageError(f"at most {len(LABELS)} models can be compared at once (got {num_models})")
    rng = np.random.default_rng(seed)
    return [rng.permutation(num_models).tolist() for _ in range(num_prompts)]


def sheet_rows(prompts: Sequence[str], responses: Sequence[Sequence[str]],
               assignment: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """The blind rows `{prompt_id, prompt, label, response}`, labels in order; `responses[model][prompt]`."""
    return [{"prompt_id": p, "prompt": prompts[p], "label": LABELS[slot], "response": responses[model][p]}
            for p, order in enumerate(assignment) for slot, model in enumerate(order)]


def key_of(models: Sequence[str], assignment: Sequence[Sequence[int]], seed: int) -> dict[str, Any]:
    return {"models": list(models), "seed": seed,
            "labels": {str(p): {LABELS[slot]: models[m] for slot, m in enumerate(order)}
                       for p, order in enumerate(assignment)}}


def rate(outcomes: Sequence[float]) -> tuple[float, float, float]:
    """`(mean, low, high)`: the mean of outcomes in [0, 1] with a 95% normal interval, clipped to [0, 1]."""
    o = np.asarray(outcomes, np.float64)
    if o.size == 0:
        return float("nan"), float("nan"), float("nan")
    half = 1.96 * o.std() / math.sqrt(o.size)
    return float(o.mean()), max(0.0, float(o.mean() - half)), min(1.0, float(o.mean() + half))


def win_rates(scores: np.ndarray, models: Sequence[str]) -> dict[str, tuple[float, float, float]]:
    """`"i vs j" -> rate(o)` for each ordered pair i < j of `scores [M, P]` (see the module docstring)."""
    out = {}
    for i, j in itertools.combinations(range(len(models)), 2):
        o = np.where(scores[i] > scores[j], 1.0, np.where(scores[i] == scores[j], 0.5, 0.0))
        out[f"{models[i]} vs {models[j]}"] = rate(o)
    return out


def reveal(votes: Sequence[dict[str, str]], key: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """Each model's share of the votes `{prompt_id, preferred}` (a label), mapped through the key."""
    labels, models = key["labels"], key["models"]
    chosen = []
    for i, vote in enumerate(votes, start=2):
        pid, label = str(vote.get("prompt_id", "")).strip(), str(vote.get("preferred", "")).strip().upper()
        if not label:
            continue  # not voted
        if pid not in labels or label not in labels[pid]:
            raise DataError(f"votes line {i}: prompt_id {pid!r} / preferred {label!r} is not in the key "
                            f"(labels {', '.join(sorted(labels.get(pid, {})))})")
        chosen.append(labels[pid][label])
    if not chosen:
        raise DataError("the votes file has no filled 'preferred' column")
    return {m: rate([float(c == m) for c in chosen]) for m in models}


def render_sheet(rows: Sequence[dict[str, Any]]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>blind comparison</title><style>"
             "body{font-family:sans-serif;margin:20px;max-width:1000px} td,th{border:1px solid #ccc;padding:4px;"
             "vertical-align:top} table{border-collapse:collapse;width:100%} pre{white-space:pre-wrap;margin:0}"
             "</style></head><body><h1>Blind comparison</h1><p>For each prompt, write the label of the best "
             "response in votes.csv (column preferred).</p>"]
    for pid, group in itertools.groupby(rows, key=lambda r: r["prompt_id"]):
        group = list(group)
        parts.append(f"<h3>Prompt {pid}</h3><pre>{html.escape(group[0]['prompt'])}</pre><table>")
        for r in group:
            parts.append(f"<tr><th>{r['label']}</th><td><pre>{html.escape(r['response'])}</pre></td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _judge(spec: str) -> tuple[str, Any]:
    from jaxrl_llm.rewards import resolve_reward

    if Path(spec).is_dir():
        return "reward_model", resolve_reward("reward_model", {"path": spec})
    return spec, resolve_reward(spec)


def _none(prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> list[float]:
    return [0.0] * len(completions)


def generate(args: argparse.Namespace) -> tuple[list[str], list[list[str]], np.ndarray | None]:
    """The rendered prompts, each model's responses `[M][P]`, and the judge's scores `[M, P]` (or None)."""
    import jax

    from jaxrl_llm.config import DataSection
    from jaxrl_llm.data import build_prompt_set, load_records
    from jaxrl_llm.evaluation import generate_scored
    from jaxrl_llm.export import load_model
    from jaxrl_llm.sampling import SamplingConfig

    judge = _judge(args.judge) if args.judge else ("none", _none)
    records, label = load_records(args.prompts)
    prompts, responses, scores = None, [], []
    for spec in args.models:
        model = load_model(spec)
        data = DataSection(chat_template=args.chat, max_prompt_tokens=1 << 30)
        prompt_set = build_prompt_set(records, label, data, model.tokenizer)
        sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  greedy=args.temperature == 0, eos_ids=model.eos_ids, pad_id=model.pad_id)
        scored = generate_scored(model.params, model.model_config, model.tokenizer, prompt_set, judge, sampling,
                                 batch_size=args.batch_size, limit=args.limit or None,
                                 key=jax.random.key(args.seed))
        if prompts is not None and scored.prompts != prompts:
            raise UsageError(f"{spec} renders the prompts differently from {args.models[0]} (another tokenizer or "
                             f"chat template); compare models that share one")
        prompts = scored.prompts
        responses.append(scored.completions)
        scores.append(scored.rewards)
    return prompts or [], responses, np.stack(scores) if args.judge else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jaxrl_llm.compare", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[], help="HF directories, RUN_DIR or RUN_DIR:STEP")
    parser.add_argument("--prompts", default="", help="JSONL prompts (with the fields a --judge reward reads)")
    parser.add_argument("--out", default="compare", help="folder for the sheet and the key")
    parser.add_argument("--limit", type=int, default=0, help="first N prompts (0: all)")
    parser.add_argument("--chat", action="store_true", help="render prompts with the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--greedy", action="store_true", help="argmax answers (the default)")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sample at this temperature")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the label shuffle's (and sampling's) seed")
    parser.add_argument("--judge", default="", help="reward name, module:function or reward-model directory")
    parser.add_argument("--reveal", default="", help="a filled votes CSV (prompt_id, preferred)")
    parser.add_argument("--key", default="", help="with --reveal: the key.json (default: beside the votes)")
    args = parser.parse_args(argv)
    if args.reveal:
        return args
    if len(args.models) < 2 or not args.prompts:
        parser.error("--models needs at least two models, and --prompts a file (or use --reveal VOTES.csv)")
    if args.temperature < 0 or args.max_new_tokens < 1 or args.batch_size < 1:
        parser.error("--temperature must be >= 0, --max-new-tokens and --batch-size >= 1")
    return args


def _print_rates(title: str, rates: dict[str, tuple[float, float, float]]) -> None:
    print(title)
    width = max(len(k) for k in rates)
    for name, (mean, low, high) in rates.items():
        print(f"  {name:<{width}}  {mean:.3f}  [{low:.3f}, {high:.3f}]")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reveal:
        votes_path = Path(args.reveal)
        key_path = Path(args.key) if args.key else votes_path.parent / "key.json"
        if not votes_path.is_file() or not key_path.is_file():
            raise UsageError(f"--reveal needs the votes file {votes_path} and the key {key_path} (--key)")
        with votes_path.open(newline="") as f:
            votes = list(csv.DictReader(f))
        rates = reveal(votes, json.loads(key_path.read_text()))
        _print_rates(f"share of the votes ({sum(1 for v in votes if v.get('preferred', '').strip())} votes, "
                     f"95% interval):", rates)
        return 0
    prompts, responses, scores = generate(args)
    assignment = blind_assignment(len(prompts), len(args.models), args.seed)
    rows = sheet_rows(prompts, responses, assignment)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sheet.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt_id", "prompt", "label", "response"])
        writer.writeheader()
        writer.writerows(rows)
    with (out / "votes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt_id", "preferred"])
        writer.writerows([[p, ""] for p in range(len(prompts))])
    (out / "sheet.html").write_text(render_sheet(rows))
    (out / "key.json").write_text(json.dumps(key_of(args.models, assignment, args.seed), indent=1) + "\n")
    print(f"wrote {out / 'sheet.html'}, {out / 'sheet.csv'} and {out / 'votes.csv'} for the raters; the key is "
          f"{out / 'key.json'}")
    if scores is not None:
        (out / "judge.json").write_text(json.dumps({"judge": args.judge, "models": args.models,
                                                    "scores": scores.tolist()}) + "\n")
        print(f"judge {args.judge}: mean score per model: " +
              ", ".join(f"{m} {s.mean():.3f}" for m, s in zip(args.models, scores, strict=True)))
        _print_rates(f"win rate of the first over the second ({len(prompts)} prompts; ties count 1/2; 95% interval):",
                     win_rates(scores, args.models))
    return 0


if __name__ == "__main__":
    sys.exit(run_command("python -m jaxrl_llm.compare", main))
