"""jaxrl_llm trainer: `python train.py --algo grpo [--config FILE] [--resume] [section.field=value ...]`.

Without `--config`, each algorithm runs its offline default preset on the arithmetic task
(`configs/grpo_arithmetic.yaml`, `configs/sft_arithmetic.yaml`). Dotted overrides such as `grpo.beta=0.04
steps=10` are applied last and type-checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIGS = {
    "grpo": ROOT / "configs" / "grpo_arithmetic.yaml",
    "sft": ROOT / "configs" / "sft_arithmetic.yaml",
    "rm": ROOT / "configs" / "rm_arithmetic.yaml",
    "rloo": ROOT / "configs" / "rloo_arithmetic.yaml",
    "reinforce_pp": ROOT / "configs" / "reinforce_pp_arithmetic.yaml",
    "ppo": ROOT / "configs" / "ppo_arithmetic.yaml",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=sorted(DEFAULT_CONFIGS), default="grpo")
    parser.add_argument("--config", type=Path, help="YAML preset (default: the algorithm's offline preset)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.beta=0.04 steps=10")
    args = parser.parse_args(argv)

    from jaxrl_llm.config import ConfigError, load_run_config

    try:
        config = load_run_config(args.config or DEFAULT_CONFIGS[args.algo], args.overrides, algo=args.algo)
    except ConfigError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    try:
        from jaxrl_llm.sharding import initialize_distributed

        d = config.distributed
        initialize_distributed(d.enabled, d.coordinator_address, d.num_processes, d.process_id, d.local_device_ids)
        if args.algo == "rm":
            from jaxrl_llm.reward_training import train_reward_model

            summary = train_reward_model(config)
        elif args.algo == "sft":
            from jaxrl_llm.sft import train_sft

            summary = train_sft(config)
        elif args.algo == "ppo":
            from jaxrl_llm.ppo import train_ppo

            summary = train_ppo(config, resume=args.resume)
        else:
            from jaxrl_llm.trainer import train_grpo  # GRPO, RLOO and REINFORCE++ share one loop

            summary = train_grpo(config, resume=args.resume)
    except ConfigError as e:  # relations only known once devices / data are there (e.g. batch vs mesh)
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    before = summary.get("before", {}).get("eval/accuracy")
    after = summary.get("after", {}).get("eval/accuracy")
    if before is not None and after is not None:
        gain = 100 * (after - before)
        print(f"held-out greedy accuracy: before {before:.3f} -> after {after:.3f} ({gain:+.1f} points)")
    elif after is not None:
        print(f"held-out greedy accuracy: {after:.3f}")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
