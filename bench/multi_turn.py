"""The rollout cost of a multi-turn episode against a single-turn completion of the same total tokens.

    python bench/multi_turn.py [--rows 128] [--turns 3] [--turn-tokens 16] [--reply-tokens 8] [--repeats 5]

On the default job's model (models/arith-base) and prompts, with EOS turned off so every row has exactly the tokens
asked for. Single turn: one sampler call of `turns * turn_tokens + (turns - 1) * reply_tokens` new tokens. Multi
turn, as `trainers/trajectories.py` rolls out: `turns` sampler calls of `turn_tokens` each, the conversation so
far (prompt, the turns, `reply_tokens` of environment reply between them) re-prefilled before each, since no KV
cache is carried across turns. Both end with the same [rows, total] completion arrays, so the update that follows
costs the same; the difference is the rollout's. Prints the best-of-`repeats` seconds of each (after a compile
call) and their ratio.

The same two rollouts through the rollout engine (`sampling.engine=paged`, `jaxrl_llm/engine`): one call of
`total` tokens, and `turns` calls whose conversations stay in the engine's pages, so each later turn prefills only
the reply (and the turn's last token); its ratio is printed as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_int_options, best_seconds  # noqa: E402
from jaxrl_llm.data import load_records  # noqa: E402
from jaxrl_llm.engine import Engine, Request, row_keys  # noqa: E402
from jaxrl_llm.models.hf import load_hf_model  # noqa: E402
from jaxrl_llm.models.tokenizer import load_tokenizer  # noqa: E402
from jaxrl_llm.sampling import SamplingConfig, sample  # noqa: E402
from jaxrl_llm.sampling.padding import left_pad  # noqa: E402


def multi_turn(params, config, prompts: list[list[int]], sampling: SamplingConfig, turns: int, reply: list[int],
               key: jax.Array) -> np.ndarray:
    """`turns` sampler calls, each re-prefilling the conversation so far; the completion tokens [rows, total]."""
    contexts = [list(p) for p in prompts]
    completions: list[list[int]] = [[] for _ in prompts]
    for turn in range(turns):
        width = max(map(len, contexts))
        tokens, mask = left_pad(contexts, width + (-width) % sampling.prompt_bucket, sampling.pad_id)
        out = jax.device_get(sample(params, config, tokens, mask, jax.random.fold_in(key, turn), sampling))
        for r, row in enumerate(np.asarray(out.tokens)):
            added = row.tolist() + (reply if turn < turns - 1 else [])
            contexts[r] += added
            completions[r] += added
    return np.asarray(completions)


def engine_turns(engine: Engine, params, prompts: list[list[int]], sampling: SamplingConfig, turns: int,
                 reply: list[int], key: jax.Array) -> int:
    """`turns` engine calls, each conversation continued from its pages; returns the completion tokens made."""
    keys = row_keys(key, len(prompts))  # as a run's episodes key their rows (trainers/trajectories.py)
    requests = [Request(p, keys[r]) for r, p in enumerate(prompts)]
    made = 0
    for turn in range(turns):
        done = [group[0] for group in engine.generate(params, requests, sampling, keep=turn < turns - 1)]
        made += sum(len(c.tokens) for c in done)
        keys = row_keys(jax.random.fold_in(key, turn + 1), len(done))
        requests = [Request(reply, keys[r], conversation=c.conversation) for r, c in enumerate(done)]
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_options(parser, {"--rows": 128, "--turns": 3, "--turn-tokens": 16, "--reply-tokens": 8, "--repeats": 5})
    args = parser.parse_args()
    model_dir = ROOT / "models" / "arith-base"
    config, params = load_hf_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    records, _ = load_records(str(ROOT / "data" / "arithmetic" / "train.jsonl"))
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in records[: args.rows]]
    total = args.turns * args.turn_tokens + (args.turns - 1) * args.reply_tokens
    base = SamplingConfig(max_new_tokens=total, temperature=1.0, eos_ids=(), pad_id=int(tokenizer.pad_token_id),
                          prompt_bucket=16, new_tokens_bucket=16)
    reply = tokenizer("= ok; ")["input_ids"][: args.reply_tokens]
    reply += reply[-1:] * (args.reply_tokens - len(reply))
    key = jax.random.key(0)
    width = max(map(len, prompts))
    tokens, mask = left_pad(prompts, width + (-width) % 16, base.pad_id)

    def single() -> None:
        jax.block_until_ready(sample(params, config, tokens, mask, key, base).tokens)

    turn = dataclasses.replace(base, max_new_tokens=args.turn_tokens)
    assert multi_turn(params, config, prompts, turn, args.turns, reply, key).shape == (args.rows, total)
    single()  # compiles
    single_s = best_seconds(single, repeats=args.repeats)
    multi_s = best_seconds(lambda: multi_turn(params, config, prompts, turn, args.turns, reply, key),
                           repeats=args.repeats)
    print(f"| rollout of {args.rows} rows, {total} completion tokens each | seconds (best of {args.repeats}) |")
    print("| --- | --- |")
    print(f"| single turn: one sampler call of {total} tokens | {single_s:.3f} |")
    print(f"| {args.turns} turns of {args.turn_tokens} tokens + {args.reply_tokens}-token replies, re-prefilled "
          f"| {multi_s:.3f} |")
    print(f"multi-turn / single-turn rollout: {multi_s / single_s:.2f}x")
    pages = args.rows * -(-(width + total) // 16) + 8
    engine = Engine(config, num_pages=pages, page_size=16, slots=args.rows, steps_per_call=16)

    def engine_single() -> None:
        keys = row_keys(key, len(prompts))
        engine.generate(params, [Request(p, keys[r]) for r, p in enumerate(prompts)], base)

    assert engine_turns(engine, params, prompts, turn, args.turns, reply, key) == args.rows * args.turns * \
        args.turn_tokens
    engine_single()  # compiles
    engine_single_s = best_seconds(engine_single, repeats=args.repeats)
    engine_multi_s = best_seconds(lambda: engine_turns(engine, params, prompts, turn, args.turns, reply, key),
                                  repeats=args.repeats)
    print(f"| engine, single turn | {engine_single_s:.3f} |")
    print(f"| engine, {args.turns} turns, conversations kept in the pages | {engine_multi_s:.3f} |")
    print(f"engine: multi-turn / single-turn rollout: {engine_multi_s / engine_single_s:.2f}x")


if __name__ == "__main__":
    main()
