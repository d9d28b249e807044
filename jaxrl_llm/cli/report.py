"""A run report: `report.html` with PNG plots (matplotlib) of one or several runs overlaid, and samples.

    python -m jaxrl_llm report RUN_DIR [RUN_DIR ...] [--out DIR] [--samples N]

Reads each run's `metrics.jsonl`, `samples.jsonl`, `summary.json` and `config.yaml`; writes to `--out`
(default: RUN_DIR/report for one run, `report/` in the current folder for several) one PNG per entry of
`PLOTS` and `report.html` around them: a summary table (steps, held-out accuracy before and after,
diagnostics named), the plots, and sample completions at several steps. A plot whose metrics a run did not
log says so in its panel, so every report has every image.
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.errors import RunDirError, UsageError
from jaxrl_llm.run.manifest import claim, unowned_existing

# name -> (title, y label, metric keys or key prefixes ending in "/"); a second list is drawn on a twin axis.
PLOTS: dict[str, tuple[str, str, list[str], list[str]]] = {
    "reward": ("Reward (mean, band: +-std)", "reward", ["reward/mean"], []),
    "reward_functions": ("Each reward function (mean)", "reward", ["reward/*/mean"], []),
    "accuracy": ("Held-out greedy accuracy", "accuracy", ["eval/accuracy", "eval/pair_accuracy"], []),
    "kl": ("KL to the reference, and drift from the initial policy", "nats/token", ["kl", "drift_kl"], []),
    "entropy": ("Entropy", "nats/token", ["entropy"], []),
    "clip_fraction": ("Clip fractions", "fraction", ["clip_fraction/low", "clip_fraction/high",
                                                     "clip_fraction"], []),
    "lengths": ("Completion lengths (tokens) and the truncated fraction (dashed, right)", "tokens",
                ["completion_length/mean", "completion_length/max"], ["frac_truncated"]),
    "turns": ("Turns and tool calls per episode, and failed calls (dashed, right)", "per episode",
              ["turns/mean", "tool_calls/mean", "eval/turns", "eval/tool_calls"], ["tool_errors/frac"]),
    "time": ("Time per step (s, log scale) and rollout tokens/s (dashed, right)", "seconds",
             ["time/rollout", "time/data", "time/update", "time/step"], ["tokens_per_second"]),
}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def load_run(run_dir: Path) -> dict[str, Any]:
    """A run's rows, samples and summary; `UsageError` when it has no metrics."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if not metrics:
        raise UsageError(f"{run_dir} has no metrics.jsonl rows: not a run directory (or no step finished yet)")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"name": run_dir.name or str(run_dir), "dir": run_dir, "metrics": metrics,
            "samples": read_jsonl(run_dir / "samples.jsonl"), "summary": summary}


def expand_keys(patterns: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
    """The metric keys matching `patterns` (a `*` matches one path segment), in pattern order."""
    present = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"})
    out: list[str] = []
    for pattern in patterns:
        if "*" in pattern:
            head, _, tail = pattern.partition("*")
            out += [k for k in present if k.startswith(head) and k.endswith(tail) and "/" not in
                    k[len(head) : len(k) - len(tail)] and len(k) > len(head) + len(tail)]
        elif pattern in present:
            out.append(pattern)
    return out


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """`(steps, values)` of `key` over the rows that hold it as a finite number."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot(name: str, runs: Sequence[dict[str, Any]], path: Path) -> None:
    """One PNG: the metrics of `PLOTS[name]` for every run (a colour per run, a line style per metric)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title, ylabel, left, right = PLOTS[name]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=90)
    twin = ax.twinx() if right else None
    drawn = 0
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        color = f"C{i}"
        for j, key in enumerate(expand_keys(left, run["metrics"])):
            xs, ys = series(run["metrics"], key)
            if not xs:
                continue
            label = f"{run['name']}: {key}" if len(runs) > 1 else key
            ax.plot(xs, ys, styles[j % len(styles)], color=color if len(runs) > 1 else f"C{j}", label=label,
                    marker="o" if len(xs) < 30 else None, markersize=3)
            drawn += 1
            if key == "reward/mean":
                sx, sd = series(run["metrics"], "reward/std")
                if sx == xs:
                    ax.fill_between(xs, [y - s for y, s in zip(ys, sd, strict=True)],
                                    [y + s for y, s in zip(ys, sd, strict=True)], color=color, alpha=0.15)
        if twin is not None:
            for key in expand_keys(right, run["metrics"]):
                xs, ys = series(run["metrics"], key)
                if xs:
                    label = f"{run['name']}: {key}" if len(runs) > 1 else key
                    twin.plot(xs, ys, "--", color=color if len(runs) > 1 else "C7", label=label, alpha=0.8)
                    twin.set_ylabel(key)
                    drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "not logged by " + ("these runs" if len(runs) > 1 else "this run"), ha="center",
                va="center", transform=ax.transAxes, color="gray")
    if name == "time" and drawn:
        ax.set_yscale("log")  # the first step's compilation is 10-100x a step: linear axes flatten the rest
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sample_steps(samples: Sequence[dict[str, Any]], count: int = 3) -> list[int]:
    """Up to `count` sampled steps spread over the run: the first, the last and evenly between."""
    steps = sorted({int(s["step"]) for s in samples if "step" in s})
    if len(steps) <= count:
        return steps
    return sorted({steps[i * (len(steps) - 1) // (count - 1)] for i in range(count)})


def _summary_rows(run: dict[str, Any]) -> list[str]:
    s, rows = run["summary"], run["metrics"]
    last = max(int(r["step"]) for r in rows)
    before = s.get("before", {}).get("eval/accuracy")
    after = s.get("after", {}).get("eval/accuracy")
    symptoms = ", ".join(f"{k} (steps {v['first_step']}-{v['last_step']})" for k, v in
                         s.get("diagnostics", {}).items()) or "none"
    fmt = (lambda v: "-" if v is None else f"{v:.3f}")
    return [html.escape(str(x)) for x in (run["name"], last, fmt(before), fmt(after), symptoms,
                                          s.get("export", "-"))]


def render_html(runs: Sequence[dict[str, Any]], images: Sequence[str], samples_per_step: int) -> str:
    """The report page (every image relative to the page; a script marks how many images loaded)."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>jaxrl_llm report</title><style>",
             "body{font-family:sans-serif;margin:20px;max-width:1100px} table{border-collapse:collapse;"
             "margin:8px 0} td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;vertical-align:top}"
             " img{max-width:100%;margin:4px 0} pre{white-space:pre-wrap;margin:0}"
             " .plots{display:grid;grid-template-columns:1fr 1fr;gap:4px}"
             " .model{background:#eef5ff;margin:2px 0} .env{background:#f4f4f4;margin:2px 0;color:#444}"
             "</style></head><body>",
             "<h1>Run report</h1><table><tr><th>run</th><th>last step</th><th>accuracy before</th>"
             "<th>accuracy after</th><th>diagnostics</th><th>export</th></tr>"]
    for run in runs:
        parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in _summary_rows(run)) + "</tr>")
    parts.append("</table><h2>Metrics</h2><div class='plots'>")
    for image in images:
        parts.append(f"<div><img src='{html.escape(image)}' alt='{html.escape(image)}'></div>")
    parts.append("</div><h2>Samples</h2>")
    for run in runs:
        for step in sample_steps(run["samples"]):
            rows = [s for s in run["samples"] if s.get("step") == step][:samples_per_step]
            parts.append(f"<h3>{html.escape(run['name'])}, step {step}</h3><table><tr><th>prompt</th>"
                         f"<th>completion</th><th>reward</th></tr>")
            for s in rows:
                reward = s.get("reward")
                parts.append(f"<tr><td><pre>{html.escape(str(s.get('prompt', '')))}</pre></td>"
                             f"<td>{completion_html(s)}</td>"
                             f"<td>{'-' if reward is None else f'{reward:.3g}'}</td></tr>")
            parts.append("</table>")
    parts.append("<script>window.addEventListener('load',function(){var im=document.images,ok=0;"
                 "for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;}"
                 "document.body.setAttribute('data-images-loaded',ok+'/'+im.length);});</script>")
    parts.append("</body></html>")
    return "\n".join(parts)


def completion_html(sample: dict[str, Any]) -> str:
    """A sample's completion; for a multi-turn episode the whole conversation after the prompt, each message
    labelled with its role, the model's turns (`assistant`) set apart from the environment's messages."""
    conversation = sample.get("conversation")
    if not conversation:
        return f"<pre>{html.escape(str(sample.get('completion', '')))}</pre>"
    parts = []
    for message in conversation[1:]:  # the first is the prompt's
        role = str(message.get("role", ""))
        kind = "model" if role == "assistant" else "env"
        parts.append(f"<div class='{kind}'><b>{html.escape(role)}</b><pre>{html.escape(str(message.get('content')))}"
                     f"</pre></div>")
    return "".join(parts)


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None, samples_per_step: int = 4) -> Path:
    """Write the report of `run_dirs` (see the module docstring); returns the path of report.html."""
    runs = [load_run(Path(d)) for d in run_dirs]
    if len({r["name"] for r in runs}) < len(runs):  # same folder names: tell them apart by their paths
        for r in runs:
            r["name"] = str(r["dir"])
    out = Path(out) if out else (Path(run_dirs[0]) / "report" if len(runs) == 1 else Path("report"))
    for run in runs:  # into a run's folder: only a report/ the run created (or a new one, then recorded)
        if unowned_existing(run["dir"], out):
            raise RunDirError(f"{out} was not written by the run in {run['dir']} (it was there before): left alone; "
                              f"write the report elsewhere with python -m jaxrl_llm report {run['dir']} --out DIR")
        claim(run["dir"], out)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    for name in PLOTS:
        plot(name, runs, out / f"{name}.png")
        images.append(f"{name}.png")
    page = out / "report.html"
    page.write_text(render_html(runs, images, samples_per_step))
    return page


def main(argv: Sequence[str] | None = None) -> int:
    parser = CommandParser(prog="python -m jaxrl_llm report", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="training runs' out_dirs (several are overlaid)")
    parser.add_argument("--out", default="", help="report folder (default: RUN_DIR/report, or report/)")
    parser.add_argument("--samples", type=int, default=4, help="sample completions shown per step")
    args = parser.parse_args(argv)
    page = write_report(args.run_dirs, args.out or None, args.samples)
    print(f"report: {page}")
    return 0

