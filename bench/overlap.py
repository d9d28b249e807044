"""Sampling beside training: the default job's phase times synchronous (K=0) and with a staleness of one (K=1),
on 2 virtual CPU devices split 1/1 (`rollout.sampler_devices=1`) or on one mesh.

Each configuration is a `train.py` run in its own process (the device count is fixed when JAX starts); the table is
the medians over the steps after the first (which compiles): the sampler's time on a rollout (`time/rollout`),
of it the reward functions and environments (`time/reward/*`, `time/env`: host work, off the trainer's thread at
K=1), the update, the weight push (`time/weight_sync`), the trainer's wait for a rollout (`time/rollout_wait`, K=1)
and the step. The measured overlap is `(rollout + update + sync) / step`: 1.0 when nothing overlaps.

    python bench/overlap.py                 # 30 steps of the default job per configuration
    python bench/overlap.py --steps 2 --only "K=1, split 1/1"    # the smallest shape (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # name -> (virtual devices, overrides)
    "K=0, one mesh": (1, ["rollout.max_staleness=0"]),
    "K=0, split 1/1": (2, ["rollout.max_staleness=0", "rollout.sampler_devices=1"]),
    "K=1, one mesh": (1, ["rollout.max_staleness=1"]),
    "K=1, split 1/1": (2, ["rollout.max_staleness=1", "rollout.sampler_devices=1"]),
}
FIELDS = ("time/rollout", "reward+env", "time/update", "time/weight_sync", "time/rollout_wait", "time/step")


def run(name: str, devices: int, overrides: list[str], steps: int, out: Path) -> list[dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    args = [sys.executable, "train.py", f"out_dir={out}", f"steps={steps}", "eval_every=0", "eval_size=64",
            "progress_bar=false", "tensorboard=false", "export=false", "report=false", "checkpoint_every=0",
            *overrides]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench/overlap.py: {name} failed: {done.stderr.strip()[-800:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward/mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per configuration (the first is not timed)")
    parser.add_argument("--only", action="append", choices=list(CONFIGS), help="run only this configuration "
                        "(repeatable; default: all four)")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; default job, {args.steps} steps")
    print(f"{'configuration':<18}" + "".join(f"{f.removeprefix('time/'):>14}" for f in FIELDS)
          + f"{'overlap':>9}{'accuracy':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (devices, overrides) in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            rows = run(name, devices, overrides, args.steps, Path(tmp) / name.replace(" ", "_").replace("/", "-"))
            timed = rows[1:] or rows
            for r in timed:
                r["reward+env"] = sum(v for k, v in r.items() if k.startswith("time/reward/") or k == "time/env")
            med = {f: statistics.median(r.get(f, 0.0) for r in timed) for f in FIELDS}
            busy = med["time/rollout"] + med["time/update"] + med["time/weight_sync"]
            accuracy = rows[-1].get("eval/accuracy", float("nan"))
            print(f"{name:<18}" + "".join(f"{med[f]:>14.4f}" for f in FIELDS)
                  + f"{busy / max(med['time/step'], 1e-9):>9.2f}{accuracy:>10.3f}")
    print("seconds are medians per step after the first; overlap = (rollout + update + weight_sync) / step")


if __name__ == "__main__":
    main()
