"""Blind comparison of several models (e.g. SFT, an early RL checkpoint, the final one) on the same prompts.

    python -m jaxrl_llm compare --models A B C --prompts FILE [--out DIR] [--limit N] [--chat]
        [--max-new-tokens N] [--greedy | --temperature T] [--seed S] [--judge REWARD_OR_REWARD_MODEL_DIR]
    python -m jaxrl_llm compare --reveal VOTES.csv --key DIR/key.json

Each model (a HF directory, RUN_DIR or RUN_DIR:STEP) answers every prompt (greedy by default). The blind sheet
shows each prompt's answers under the labels A, B, C, ... with the models shuffled per prompt (a permutation
drawn per prompt from `--seed`); the key is a separate file:

    DIR/sheet.html, DIR/sheet.csv    prompt_id, prompt, label, response, sheet_id (for the raters)
    DIR/votes.csv                    prompt_id, preferred, sheet_id: a template to fill with the preferred label
    DIR/key.json                     sheet_id, and per prompt, label -> model (keep it from the raters)

The sheet's identity, `sheet_id`, ties the three together: the first 16 hex digits of the sha256 of the rows
`[prompt_id, prompt, label, response]` sorted by (prompt_id, label), as compact JSON (`sheet_id(rows)`). It covers
the responses too, not just the prompts and labels, so that two sheets of the same prompts with another `--seed`
(other label -> response pairs) or other models also differ; it never covers which model wrote what, so it tells
the raters nothing the sheet does not. sheet.html shows it, every row of sheet.csv and votes.csv carries it (keep
the column when filling the votes), and key.json records it.

`--judge` scores every response with a reward function (a built-in, module:function, or the directory of a
reward model) and prints, for each pair of models, the win rate of the first over the second,

    win_rate(i, j) = mean over prompts of o_p,  o_p = 1 if s_i > s_j, 1/2 if s_i == s_j, else 0

with a 95% interval mean +- 1.96 * std(o) / sqrt(P) (clipped to [0, 1]). `--reveal` joins the filled votes
with the key and prints each model's share of the votes (same interval). It refuses (exit 2) votes whose rows
carry different sheet ids, votes and a key of different sheets, and a vote for a prompt or label the key lacks;
votes or a key without a sheet id (written before sheet ids) are accepted with a warning that they cannot be
matched.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import html
import itertools
import json
import math
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.cli.export import load_model
from jaxrl_llm.config import DataSection
from jaxrl_llm.data import build_prompt_set, load_records
from jaxrl_llm.errors import DataError, UsageError
from jaxrl_llm.evaluation import generate_scored
from jaxrl_llm.rewards import resolve_reward
from jaxrl_llm.sampling import SamplingConfig

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


def sheet_id(rows: Sequence[dict[str, Any]]) -> str:
    """The sheet's identity: 16 hex digits of the sha256 of its `[prompt_id, prompt, label, response]` rows (see
    the module docstring). Extra fields (a `sheet_id` column read back from sheet.csv) are ignored, and prompt_id
    is hashed as text, so rows read back from sheet.csv give the id they were written with."""
    # Sorted, so the id is the sheet's content whatever order a spreadsheet kept the rows in.
    canon = sorted([str(r["prompt_id"]), str(r["prompt"]), str(r["label"]), str(r["response"])] for r in rows)
    blob = json.dumps(canon, ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def key_of(models: Sequence[str], assignment: Sequence[Sequence[int]], seed: int,
           sheet: str | None = None) -> dict[str, Any]:
    """The key: per prompt, label -> model; with `sheet`, the `sheet_id` of the sheet it decodes."""
    key: dict[str, Any] = {"models": list(models), "seed": seed}
    if sheet is not None:
        key["sheet_id"] = sheet
    key["labels"] = {str(p): {LABELS[slot]: models[m] for slot, m in enumerate(order)}
                     for p, order in enumerate(assignment)}
    return key


def votes_sheet_id(votes: Sequence[dict[str, str]], votes_name: str = "the votes") -> str | None:
    """The one sheet id the votes' rows carry, or None if they carry none (a file from before sheet ids, or the
    column dropped). Rows with different ids, or some with an id and some without, are refused: such a file mixes
    sheets, and its votes cannot all be decoded by one key."""
    ids: dict[str, int] = {}  # id ("" for none) -> first line (the header is line 1)
    for line, vote in enumerate(votes, start=2):
        if not any(str(v or "").strip() for v in vote.values()):
            continue  # a blank line a spreadsheet left at the end
        ids.setdefault(str(vote.get("sheet_id") or "").strip(), line)
    if set(ids) <= {""}:
        return None
    if len(ids) > 1:
        found = ", ".join(f"{i or 'none'} (from line {line})" for i, line in ids.items())
        raise UsageError(f"{votes_name} mixes the votes of several sheets: its rows carry the sheet ids {found}; "
                         f"reveal each sheet's votes separately, with its own key")
    return next(iter(ids))


def check_same_sheet(votes: Sequence[dict[str, str]], key: dict[str, Any], votes_name: str = "the votes",
                     key_name: str = "the key") -> str:
    """Raise UsageError unless the votes and the key are of one sheet; return a warning ("" if none) when either
    has no sheet id to compare (written before sheet ids: accepted, so old sheets still reveal)."""
    of_votes, of_key = votes_sheet_id(votes, votes_name), key.get("sheet_id")
    if of_votes is not None and of_key is not None and of_votes != of_key:
        raise UsageError(f"{votes_name} is for sheet {of_votes} but {key_name} is the key of sheet {of_key}; "
                         f"reveal a sheet's votes with its own key")
    missing = [name for name, i in ((votes_name, of_votes), (key_name, of_key)) if i is None]
    if missing:
        return (f"{' and '.join(missing)} {'carry' if len(missing) > 1 else 'carries'} no sheet id (written before "
                f"sheet ids, or the column was dropped), so the votes cannot be matched to the key: make sure "
                f"they are of the same sheet")
    return ""


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
    """Each model's share of the votes `{prompt_id, preferred}` (a label), mapped through the key. Whether the
    votes are of the key's sheet is `check_same_sheet`'s to say; this refuses a vote the key cannot decode."""
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


def load_key(path: Path) -> dict[str, Any]:
    """key.json, checked to be a compare key (a wrong file is a one-line error, not a KeyError)."""
    try:
        key = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not a compare key (not JSON: {e})") from e
    if (not isinstance(key, dict) or not isinstance(key.get("models"), list)
            or not isinstance(key.get("labels"), dict)
            or not all(isinstance(v, dict) for v in key["labels"].values())
            or not isinstance(key.get("sheet_id") or "", str)):
        raise DataError(f"{path} is not a compare key (it needs 'models', 'labels': {{prompt_id: {{label: model}}}} "
                        f"and, since sheet ids, a 'sheet_id' string): pass the key.json the sheet was written with")
    return key


def render_sheet(rows: Sequence[dict[str, Any]], sheet: str = "") -> str:
    """sheet.html; with `sheet`, its sheet_id is shown, so a rater can see which sheet votes.csv belongs to."""
    ident = f"<p>Sheet <code>{html.escape(sheet)}</code> (votes.csv carries the same sheet_id).</p>" if sheet else ""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>blind comparison</title><style>"
             "body{font-family:sans-serif;margin:20px;max-width:1000px} td,th{border:1px solid #ccc;padding:4px;"
             "vertical-align:top} table{border-collapse:collapse;width:100%} pre{white-space:pre-wrap;margin:0}"
             "</style></head><body><h1>Blind comparison</h1><p>For each prompt, write the label of the best "
             f"response in votes.csv (column preferred).</p>{ident}"]
    for pid, group in itertools.groupby(rows, key=lambda r: r["prompt_id"]):
        group = list(group)
        parts.append(f"<h3>Prompt {pid}</h3><pre>{html.escape(group[0]['prompt'])}</pre><table>")
        for r in group:
            parts.append(f"<tr><th>{r['label']}</th><td><pre>{html.escape(r['response'])}</pre></td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _judge(spec: str) -> tuple[str, Any]:

    if Path(spec).is_dir():
        return "reward_model", resolve_reward("reward_model", {"path": spec})
    return spec, resolve_reward(spec)


def _none(prompts: Sequence[str], completions: Sequence[str], **fields: Any) -> list[float]:
    return [0.0] * len(completions)


def generate(args: argparse.Namespace) -> tuple[list[str], list[list[str]], np.ndarray | None]:
    """The rendered prompts, each model's responses `[M][P]`, and the judge's scores `[M, P]` (or None)."""

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
    parser = CommandParser(prog="python -m jaxrl_llm compare", description=__doc__,
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
        key = load_key(key_path)
        warning = check_same_sheet(votes, key, votes_name=str(votes_path), key_name=str(key_path))
        if warning:
            print(f"python -m jaxrl_llm compare: warning: {warning}", file=sys.stderr)
        rates = reveal(votes, key)
        _print_rates(f"share of the votes ({sum(1 for v in votes if str(v.get('preferred') or '').strip())} votes, "
                     f"95% interval):", rates)
        return 0
    prompts, responses, scores = generate(args)
    assignment = blind_assignment(len(prompts), len(args.models), args.seed)
    rows = sheet_rows(prompts, responses, assignment)
    sheet = sheet_id(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sheet.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt_id", "prompt", "label", "response", "sheet_id"])
        writer.writeheader()
        writer.writerows([{**r, "sheet_id": sheet} for r in rows])
    with (out / "votes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        # sheet_id last, after the column the raters fill, and on every row so that it survives row edits.
        writer.writerow(["prompt_id", "preferred", "sheet_id"])
        writer.writerows([[p, "", sheet] for p in range(len(prompts))])
    (out / "sheet.html").write_text(render_sheet(rows, sheet))
    (out / "key.json").write_text(json.dumps(key_of(args.models, assignment, args.seed, sheet), indent=1) + "\n")
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

