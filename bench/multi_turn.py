"""Time of a multi-turn GRPO step against a single-turn step of the same total tokens, on the default job's model.

    python bench/multi_turn.py [--steps 12] [--turns 3] [--turn-tokens 16]

Both runs are the default preset (configs/grpo_arithmetic.yaml, 16 prompts x 8 samples). The multi-turn run's
episodes have `--turns` model turns of at most `--turn-tokens` tokens each, separated by a fixed environment reply
(`echo` below, masked out of the loss); the single-turn run samples one completion of at most the same total
(the model's tokens plus the replies'). A turn after the first re-prefills the conversation so far (no KV cache
is carried across turns), so the difference is the cost of re-prefill and of the smaller sampler calls. Prints
the median seconds per step (rollout, update, whole step, after the compile steps) and the tokens each step held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrl_llm.envs.base import StepResult  # noqa: E402
from jaxrl_llm.preflight import load_config  # noqa: E402
from jaxrl_llm.trainers import make_trainer  # noqa: E402

REPLY = "Check it and go on: "


class Echo:
    """Replies REPLY after each of the model's turns, `turns - 1` times, then ends the episode."""

    def __init__(self, record: dict, *, turns: int = 3) -> None:
        self.record, self.turns, self.seen = record, turns, 0

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.record["prompt"]}]

    def step(self, text: str) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult([] if done else [{"role": "user", "content": REPLY}], 0.0, done, {})


def echo(record: dict, **kwargs: object) -> Echo:
    return Echo(record, **kwargs)


def run(name: str, out: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    """Median timings (after the first two steps, which compile) and tokens per step of one run."""
    config = load_config(ROOT / "configs" / "grpo_arithmetic.yaml",
                         [f"out_dir={out / name}", f"steps={steps}", "data.eval=", "checkpoint_every=0", "export=false",
                          "progress_bar=false", "tensorboard=false", "report=false", "sample_every=0", *overrides])
    make_trainer(config).run()
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][2:]
    median = {k: statistics.median(r[k] for r in rows) for k in ("time/rollout", "time/update", "time/step")}
    width = 16 * 8  # rows of a step
    model_tokens = statistics.median(r["completion_length/mean"] * width for r in rows)
    masked = statistics.median(r.get("masked_tokens/frac", 0.0) for r in rows)
    return {**median, "model_tokens": model_tokens, "all_tokens": model_tokens / (1 - masked)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16)
    args = parser.parse_args()
    from jaxrl_llm.data import load_tokenizer

    reply_tokens = len(load_tokenizer(ROOT / "models" / "arith-base")(REPLY)["input_ids"])
    total = args.turns * args.turn_tokens + (args.turns - 1) * reply_tokens
    with tempfile.TemporaryDirectory() as tmp:
        single = run("single", Path(tmp), args.steps, [f"sampling.max_new_tokens={total}"])
        multi = run("multi", Path(tmp), args.steps, [f"sampling.max_new_tokens={args.turn_tokens}",
                                                     "env.name=bench.multi_turn:echo",
                                                     f"env.kwargs={{turns: {args.turns}}}",
                                                     f"env.max_turns={args.turns}", f"env.max_tokens={total + 1}"])
    print("| run | completion budget | tokens/step (model / all) | rollout s | update s | step s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r, budget in (("single-turn", single, f"{total} tokens"),
                            (f"{args.turns} turns", multi, f"{args.turns} x {args.turn_tokens} + replies")):
        print(f"| {name} | {budget} | {r['model_tokens']:.0f} / {r['all_tokens']:.0f} | {r['time/rollout']:.3f} | "
              f"{r['time/update']:.3f} | {r['time/step']:.3f} |")
    print(f"multi-turn / single-turn step time: {multi['time/step'] / single['time/step']:.2f}x "
          f"(rollout {multi['time/rollout'] / single['time/rollout']:.2f}x)")


if __name__ == "__main__":
    main()
