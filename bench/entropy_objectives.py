"""Entropy curves of the 2025 entropy objectives against plain GRPO, on a real model (SmolLM2-135M-Instruct).

    python bench/entropy_objectives.py --model DIR [--steps 10] [--prompts 4] [--only grpo,top_entropy]
                                       [--out runs/bench_entropy] [--results bench/entropy_results.md]

Each variant is the SmolLM2 recipe (`configs/grpo_smollm2_larger_number.yaml`: "Which number is larger?", chat
template, no KL, T = 0.7, 32 new tokens; AdamW at `--lr`, 3e-5 by default, three times the recipe's, so that the
entropy falls within the few steps a CPU affords) with its config overrides, run as its own `train.py`
subprocess from the same model and seed, one after the other. The per-step `entropy` (mean per token, nats, at
the sampling temperature, measured during the update) and the held-out greedy accuracy before and after (first
`--eval-size` prompts of `data/larger_number/test.jsonl`) are read from each run's `metrics.jsonl`.

Variants: plain GRPO; high-entropy token selection (`rl.loss.top_entropy_quantile=0.2`); Clip-Cov and KL-Cov
(ratio 0.02: at most 1,024 tokens a step here, where the papers' 2e-4 would pick one); adaptive entropy control
with the target at the base model's entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from algorithms import ROOT, minutes, run  # noqa: E402

VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "grpo": ("plain GRPO", ()),
    "top_entropy": ("top-20% entropy tokens", ("rl.loss.top_entropy_quantile=0.2",)),
    "clip_cov": ("Clip-Cov", ("rl.loss.clip_cov_ratio=0.02",)),
    "kl_cov": ("KL-Cov", ("rl.loss.kl_cov_ratio=0.02",)),
    "entropy_control": ("adaptive entropy control (target 0.8)",
                        ("rl.entropy_target=0.8", "rl.entropy_coef=0.0", "rl.entropy_coef_delta=0.005")),
}


def read(out_dir: Path, steps: int) -> dict[str, object]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    train = {r["step"]: r for r in rows if "reward/mean" in r}
    if 0 not in acc or steps not in acc or sorted(train) != list(range(1, steps + 1)):
        raise RuntimeError(f"{out_dir}/metrics.jsonl lacks the evaluations or some of the {steps} steps")
    return {"before": acc[0], "after": acc[steps], "entropy": [train[s]["entropy"] for s in range(1, steps + 1)],
            "reward": [train[s]["reward/mean"] for s in range(1, steps + 1)],
            "coef": [train[s].get("entropy_coef") for s in range(1, steps + 1)]}


def table(results: dict[str, dict], steps: int) -> str:
    head = "| variant | " + " | ".join(f"H step {s}" for s in range(1, steps + 1)) + \
        " | training reward (last) | held-out accuracy before -> after | wall time |"
    lines = [head, "| --- " * (steps + 4) + "|"]
    for key, r in results.items():
        label, overrides = VARIANTS[key]
        name = label + (f" (`{' '.join(overrides)}`)" if overrides else "")
        lines.append(f"| {name} | " + " | ".join(f"{h:.3f}" for h in r["entropy"]) +
                     f" | {r['reward'][-1]:.2f} | {100 * r['before']:.1f}% -> {100 * r['after']:.1f}% "
                     f"| {minutes(r['wall'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the SmolLM2-135M-Instruct directory (fetch.py prints it)")
    parser.add_argument("--only", help="comma-separated subset of: " + ",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x 8 samples)")
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-5,
                        help="AdamW learning rate (the recipe's 1e-5 x 3: entropy falls within the few steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_entropy")
    parser.add_argument("--results", type=Path, default=None, help="markdown file for the table")
    args = parser.parse_args(argv)
    keys = [k for k in (args.only.split(",") if args.only else VARIANTS) if k]
    if unknown := sorted(set(keys) - set(VARIANTS)):
        parser.error(f"--only: unknown {unknown}; choose from {list(VARIANTS)}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    load, started = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M")
    results: dict[str, dict] = {}
    for key in keys:
        out = args.out / key
        cmd = [sys.executable, "train.py", "--overwrite", "--config", "configs/grpo_smollm2_larger_number.yaml",
               f"model.path={args.model}", *VARIANTS[key][1], f"out_dir={out}", f"steps={args.steps}",
               f"rl.prompts_per_step={args.prompts}", f"eval_size={args.eval_size}", "eval_every=0",
               f"optim.learning_rate={args.lr}",
               "checkpoint_every=0", "export=false", "report=false", "progress_bar=false", "tensorboard=false",
               f"seed={args.seed}"]
        wall = run(cmd, args.out / f"{key}.log")
        results[key] = {**read(out, args.steps), "wall": wall}
        r = results[key]
        print(f"{key}: entropy {r['entropy'][0]:.3f} -> {r['entropy'][-1]:.3f}, accuracy {r['before']:.3f} -> "
              f"{r['after']:.3f} in {minutes(wall)}", flush=True)
    text = table(results, args.steps)
    print("\n" + text)
    if args.results is not None:
        command = " ".join(["python", "bench/entropy_objectives.py", *(argv or sys.argv[1:])])
        args.results.write_text(
            f"# Entropy objectives on SmolLM2-135M-Instruct\n\n```bash\n{command}\n```\n\n"
            f"{text}\n\nRun {started} on 2 CPU cores, seed {args.seed}, {args.steps} steps of {args.prompts} "
            f"prompts x 8 samples, learning rate {args.lr:g}; 1-minute load {load[0]:.1f} at the start. H: the "
            f"step's mean entropy per token (nats). Accuracy: greedy, first {args.eval_size} held-out prompts.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
