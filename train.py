"""jaxrl_llm command-line trainer: `python train.py --algo grpo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--algo", default="grpo", choices=["grpo"])
    parser.parse_args(argv)
    print(
        "train.py: the GRPO trainer is not built yet (issue 5); the model layer is ready "
        "(see README.md).",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
