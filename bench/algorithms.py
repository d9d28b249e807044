"""The algorithms side by side on the default task: held-out greedy accuracy after the same sample budget.

    python bench/algorithms.py [--only grpo,ppo] [--steps N] [--seed 0] [--out runs/bench_algorithms]
                               [--results bench/algorithms_results.md]

Each algorithm is its own preset run as a subprocess, one after the other (`python train.py --algo A --config
configs/P.yaml out_dir=... steps=... seed=... eval_every=0 checkpoint_every=0 ...`), from the same base model
(`models/arith-base`) and seed. Accuracy, before and after, is read from the run's `metrics.jsonl` (the
evaluation records at step 0 and at the last step: greedy decoding on the first 1,000 problems of
`data/arithmetic/test.jsonl`, exact-answer check); prompts per step and group size from the run's
`config.yaml`; the completions sampled are counted from those and, for DAPO's dynamic sampling, from the
logged `dynamic_sampling/refill_rounds` (each refill round samples another prompts x group).

Same budget: every run gets the same number of steps (the default preset's 150, or `--steps`), and every preset
trains on 128 completions a step (GRPO-family: 16 prompts x 8; PPO: 32 prompts x 4). The Dr.GRPO and DAPO
presets default to 200 steps; the bench overrides `steps` so they get the same budget as the others. DAPO's
dynamic sampling still samples more than it trains on (refill rounds), which the "completions sampled" column
shows. Intermediate evaluations and checkpoints are switched off (`eval_every=0 checkpoint_every=0`) so the
wall times compare training (plus start-up, compilation, and the before/after evaluations).

The 2025 objectives are rows of the GRPO preset with config overrides (shown in the table): CISPO, SAPO,
high-entropy token selection (`rl.loss.top_entropy_quantile=0.2`), Clip-Cov, KL-Cov and adaptive entropy control. With
the preset's one update per rollout the ratio is 1 (up to sampler / trainer rounding), where CISPO's and SAPO's
gradients are GRPO's and KL-Cov's penalty `|log ratio|` is ~0; so those three, and a GRPO baseline beside them
(`grpo_mb4`), split each rollout into 4 minibatches (`rl.minibatch_size=32`: 4 updates, the ratio moves after the
first). The Cov ratios are 0.02 (about 15 of the at most 768 tokens of a rollout), not the papers' 2e-4 / 2e-3 of
batches of millions of tokens, which would pick a single token here. The "entropy at the end" column is the last
step's `entropy` (mean per token, nats, at the sampling temperature, measured during the update).

The `rm_ppo` row is the RLHF chain: `python train.py --algo rm` (Bradley-Terry reward model on
`data/arithmetic/preferences_train.jsonl`, 300 steps of 64 pairs), then PPO with
`configs/ppo_rm_arithmetic.yaml`, whose only training reward is that reward model; its wall time includes the
reward model's training, its completions count only PPO's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Algorithm:
    key: str
    label: str
    algo: str  # train.py --algo
    config: str  # preset in configs/
    overrides: tuple[str, ...] = ()  # config overrides on top of the preset (the 2025 objectives' rows)


FOUR_MINIBATCHES = ("rl.minibatch_size=32",)  # 4 updates per rollout of 128: off-policy after the first
ALGORITHMS = [
    Algorithm("grpo", "GRPO", "grpo", "grpo_arithmetic.yaml"),
    Algorithm("drgrpo", "Dr.GRPO", "grpo", "drgrpo_arithmetic.yaml"),
    Algorithm("dapo", "DAPO", "grpo", "dapo_arithmetic.yaml"),
    Algorithm("ppo", "PPO", "ppo", "ppo_arithmetic.yaml"),
    Algorithm("rloo", "RLOO", "rloo", "rloo_arithmetic.yaml"),
    Algorithm("reinforce_pp", "REINFORCE++", "reinforce_pp", "reinforce_pp_arithmetic.yaml"),
    Algorithm("rm_ppo", "RM -> PPO (learned reward)", "ppo", "ppo_rm_arithmetic.yaml"),
    # The 2025 objectives (docs/algorithms.md), each against the GRPO row of the same update schedule.
    Algorithm("top_entropy", "GRPO, top-20% entropy tokens", "grpo", "grpo_arithmetic.yaml",
              ("rl.loss.top_entropy_quantile=0.2",)),
    Algorithm("clip_cov", "GRPO + Clip-Cov", "grpo", "grpo_arithmetic.yaml", ("rl.loss.clip_cov_ratio=0.02",)),
    Algorithm("entropy_control", "GRPO + adaptive entropy control", "grpo", "grpo_arithmetic.yaml",
              ("rl.entropy_target=0.2", "rl.entropy_coef=0.0", "rl.entropy_coef_delta=0.005")),
    Algorithm("grpo_mb4", "GRPO, 4 minibatches", "grpo", "grpo_arithmetic.yaml", FOUR_MINIBATCHES),
    # TRL's / ScaleRL's CISPO: no lower bound, weight capped at eps_max = 5 (epsilon_high = eps_max - 1).
    Algorithm("cispo", "CISPO, 4 minibatches", "grpo", "grpo_arithmetic.yaml",
              (*FOUR_MINIBATCHES, "rl.policy_loss=cispo", "rl.loss.epsilon_low=1.0", "rl.loss.epsilon_high=4.0")),
    Algorithm("sapo", "SAPO, 4 minibatches", "grpo", "grpo_arithmetic.yaml",
              (*FOUR_MINIBATCHES, "rl.policy_loss=sapo")),
    Algorithm("kl_cov", "GRPO + KL-Cov, 4 minibatches", "grpo", "grpo_arithmetic.yaml",
              (*FOUR_MINIBATCHES, "rl.loss.kl_cov_ratio=0.02")),
]
COMMON = ("eval_every=0", "checkpoint_every=0", "progress_bar=false", "tensorboard=false")


def run(cmd: list[str], log: Path) -> float:
    """Run `cmd` from the repository root with its output in `log`; wall seconds. Raises on failure."""
    print("$ " + shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}; last lines of {log}:\n{tail}")
    return wall


def read_run(out_dir: Path, steps: int) -> dict[str, float]:
    """Accuracy before / after, steps done and completions sampled, from a run's metrics.jsonl and config.yaml."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    config = yaml.safe_load((out_dir / "config.yaml").read_text())
    evals = [r for r in rows if "eval/accuracy" in r]
    before = [r["eval/accuracy"] for r in evals if r["step"] == 0]
    after = [r["eval/accuracy"] for r in evals if r["step"] == steps]
    train_rows = {r["step"]: r for r in rows if "reward/mean" in r}  # one per step (log_every = 1)
    if not before or not after or sorted(train_rows) != list(range(1, steps + 1)):
        raise RuntimeError(f"{out_dir}/metrics.jsonl lacks the before/after evaluations or some of {steps} steps")
    prompts, group = config["rl"]["prompts_per_step"], config["rl"]["group_size"]
    refills = sum(int(r.get("dynamic_sampling/refill_rounds", 0)) for r in train_rows.values())
    return {"before": before[0], "after": after[-1], "steps": steps, "prompts": prompts, "group": group,
            "sampled": (steps + refills) * prompts * group, "refills": refills,
            "entropy": train_rows[steps].get("entropy", float("nan"))}


def bench(alg: Algorithm, args: argparse.Namespace) -> dict[str, float]:
    out = args.out / alg.key
    overrides = [*alg.overrides, f"out_dir={out}", f"steps={args.steps}", f"seed={args.seed}", *COMMON]
    wall = 0.0
    if alg.key == "rm_ppo":
        rm_dir = args.out / "rm"
        rm_hf = rm_dir / "hf"
        wall += run([sys.executable, "train.py", "--algo", "rm", "--overwrite", f"out_dir={rm_dir}",
                     f"export_dir={rm_hf}", f"seed={args.seed}", "progress_bar=false", "tensorboard=false"],
                    args.out / "rm.log")
        rewards = ("rewards=[{name: math_answer, weight: 0.0}, "
                   f"{{name: reward_model, weight: 1.0, kwargs: {{path: {json.dumps(str(rm_hf))}}}}}]")
        overrides += [f"ppo.critic_init={rm_hf}", rewards]
    cmd = [sys.executable, "train.py", "--algo", alg.algo, "--overwrite", "--config", f"configs/{alg.config}",
           *overrides]
    wall += run(cmd, args.out / f"{alg.key}.log")
    return {**read_run(out, args.steps), "wall": wall}


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def budget(r: dict[str, float]) -> str:
    """`steps x prompts x group`, plus the refill rounds of dynamic sampling if any."""
    text = f"{r['steps']} x {r['prompts']} x {r['group']}"
    return text + (f" + {r['refills']} refill rounds x {r['prompts'] * r['group']}" if r["refills"] else "")


def table(results: dict[str, dict[str, float]]) -> str:
    befores = {round(r["before"], 6) for r in results.values()}
    base = next(iter(results.values()))["before"]
    lines = ["| algorithm | held-out greedy accuracy | delta vs base | entropy at the end | wall time "
             "| completions sampled |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| base model (`models/arith-base`) | {100 * base:.1f}% | | | | |"]
    for alg in ALGORITHMS:
        if alg.key in results:
            r = results[alg.key]
            preset = " ".join([alg.config, *alg.overrides])
            lines.append(f"| {alg.label} (`{preset}`) | {100 * r['after']:.1f}% | "
                         f"{100 * (r['after'] - base):+.1f} points | {r['entropy']:.3f} | {minutes(r['wall'])} | "
                         f"{r['sampled']:,} ({budget(r)}) |")
    if len(befores) > 1:
        lines.append(f"\nWarning: the runs' before-evaluations differ ({sorted(befores)}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated subset of: " + ",".join(a.key for a in ALGORITHMS))
    parser.add_argument("--steps", type=int, default=150, help="steps of every run (default 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_algorithms")
    parser.add_argument("--results", type=Path, default=None,
                        help="markdown file for the table (default: bench/algorithms_results.md on a full run)")
    args = parser.parse_args(argv)
    chosen = ALGORITHMS
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = sorted(set(keys) - {a.key for a in ALGORITHMS})
        if unknown:
            parser.error(f"--only: unknown {unknown}; choose from {[a.key for a in ALGORITHMS]}")
        chosen = [a for a in ALGORITHMS if a.key in keys]
    results_path = args.results
    if results_path is None and not args.only and args.steps == 150:
        results_path = ROOT / "bench" / "algorithms_results.md"
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M")
    results: dict[str, dict[str, float]] = {}
    for alg in chosen:
        results[alg.key] = r = bench(alg, args)
        print(f"{alg.label}: {r['before']:.3f} -> {r['after']:.3f} in {minutes(r['wall'])}, "
              f"{r['sampled']:,} completions", flush=True)
    text = table(results)
    print("\n" + text)
    if results_path is not None:
        command = shlex.join(["python", "bench/algorithms.py", *(sys.argv[1:] if argv is None else argv)])
        load_after = os.getloadavg()
        notes = (
            f"Run {started} on {platform.machine()} with {os.cpu_count()} CPU cores (JAX CPU), seed {args.seed}, "
            f"one run after another; 1-minute load average {load_before[0]:.1f} at the start and "
            f"{load_after[0]:.1f} at the end (the bench's own runs included; wall times include start-up, "
            "compilation and the before/after evaluations, and depend on what else the machine runs). "
            "Accuracy: greedy decoding, exact answer, "
            "first 1,000 problems of `data/arithmetic/test.jsonl`, read from each run's `metrics.jsonl`. "
            "Completions sampled: steps x prompts x group size from each run's `config.yaml`, plus DAPO's "
            "dynamic-sampling refill rounds (logged per step); every run trains on the same steps x 128 "
            "completions. The RM -> PPO wall time includes training the reward model (`--algo rm`, 300 steps)."
        )
        results_path.write_text(f"# Algorithms on the default task\n\n```bash\n{command}\n```\n\n{text}\n\n{notes}\n")
        print(f"\nwritten to {results_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
