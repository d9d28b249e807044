"""jaxrl_llm trainer: `python train.py [--algo grpo] [--config FILE] [--resume | --overwrite] [key=value ...]`.

Without `--config`, each algorithm runs its offline default preset on the arithmetic task
(`configs/grpo_arithmetic.yaml`, `configs/sft_arithmetic.yaml`, ...); with it, `algo` comes from the file
unless `--algo` is given. Dotted overrides such as `rl.beta=0.04 steps=10` are applied last and type-checked.
Relative paths in the YAML file are relative to its folder; on the command line, to the current folder.

`--print-config` prints the resolved config, every field with a one-line comment, and exits (all fields:
docs/config-reference.md). Ctrl-C or SIGTERM stops after the current step with a checkpoint (exit 130).

A run owns what it creates, and records it in out_dir/.jaxrl_llm-run.json: a new run refuses a directory that
holds another run (`--resume` continues it, `--overwrite` starts over, deleting exactly what that run created)
or other files (except its config file's own folder, whose files it leaves alone), and `--resume` refuses
config changes to the math, or changed data files, unless `--allow-config-change`. Errors are one line on
stderr (exit 2: usage, config, data, model, disk; 1: runtime); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from jaxrl_llm.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIGS = {name: ROOT / "configs" / entry.preset for name, entry in ALGORITHMS.items()}


def _parse(argv: list[str]) -> argparse.Namespace:
    from jaxrl_llm.cli.errors import CommandParser

    parser = CommandParser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=sorted(DEFAULT_CONFIGS),
                        help="the algorithm (default: the config file's algo, else grpo)")
    parser.add_argument("--config", type=Path, help="YAML preset (default: the algorithm's offline preset)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config with a comment per field, and exit")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an out_dir that holds a run (deletes exactly what that run created)")
    parser.add_argument("--allow-tracked-dir", action="store_true",
                        help="let out_dir be a git work tree's root or a directory holding git-tracked files")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="--resume even if the config changes the math or shapes of the checkpointed run")
    parser.add_argument("--export-adapters", action="store_true",
                        help="with LoRA (lora.rank > 0): also write the adapters in PEFT format to EXPORT_DIR/adapter")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.beta=0.04 steps=10")
    return parser.parse_intermixed_args(argv)  # options and key=value overrides in any order


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from jaxrl_llm.preflight import load_config, preflight

    preset = args.config or DEFAULT_CONFIGS[args.algo or "grpo"]
    overrides = [*args.overrides, *(["lora.export_adapters=true"] if args.export_adapters else [])]
    fields = {"algo": args.algo} if args.algo else {}
    config = load_config(preset, overrides, **fields)
    if args.print_config:
        from jaxrl_llm.config.docs import commented_yaml

        print(commented_yaml(config), end="")
        return 0
    from jaxrl_llm.sharding import initialize_distributed

    d = config.distributed
    initialize_distributed(d.enabled, d.coordinator_address, d.num_processes, d.process_id, d.local_device_ids)
    preflight(config, preset, overrides, fields)  # plugins, inputs, the devices: before any model loads
    options = dict(resume=args.resume, overwrite=args.overwrite, allow_config_change=args.allow_config_change,
                   config_dir=Path(preset).parent, allow_tracked_dir=args.allow_tracked_dir)
    from jaxrl_llm.errors import RunInterrupted
    from jaxrl_llm.trainers import train

    try:
        summary = train(config, **options)
    except RunInterrupted as e:
        if "--resume" in str(e):  # the exact command that continues this run
            again = [a for a in argv if a not in ("--overwrite", "--resume")]
            raise RunInterrupted(f"{e}: python train.py {shlex.join([*again, '--resume'])}", e.step) from None
        raise
    before = summary.get("before", {}).get("eval/accuracy")
    after = summary.get("after", {}).get("eval/accuracy")
    if before is not None and after is not None:
        gain = 100 * (after - before)
        print(f"held-out greedy accuracy: before {before:.3f} -> after {after:.3f} ({gain:+.1f} points)")
    elif after is not None:
        print(f"held-out greedy accuracy: {after:.3f}")
    if "diverged" in summary:
        print(f"train.py: warning: the final policy diverged: {summary['diverged']}", file=sys.stderr)
    print(json.dumps(summary, indent=2))
    if config.report:
        import jax

        from jaxrl_llm.cli.report import write_report
        from jaxrl_llm.errors import RunDirError

        if jax.process_index() == 0:
            try:
                print(f"report: {write_report([config.out_dir])}")
            except RunDirError as e:  # a folder named report/ that is not the run's: the run is done all the same
                print(f"train.py: report skipped: {e}", file=sys.stderr)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`main` behind the error boundary: one line per error, exit 2 / 1, a traceback only with --debug."""
    from jaxrl_llm.cli.errors import run_command

    return run_command("train.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
