"""Evaluate a model on fixed prompts: accuracy, pass@k, mean reward, completion length, truncation rate.

    python -m jaxrl_llm eval --model DIR_OR_RUN_DIR[:STEP] --data FILE --reward NAME [--chat]
        [--greedy | --n K --temperature T] [--k 1,4,8] [--max-new-tokens N] [--limit N] [--batch-size N]
        [--seed S] [--out DIR]

`--model` is a Hugging Face directory (or hub id), a training run's out_dir (its latest checkpoint) or
`RUN_DIR:STEP` (the checkpoint of that step). For a run, the defaults are the run's own evaluation settings
(`eval_reward` or its first reward, `sampling.max_new_tokens`, its prompt rendering, `eval_size`,
`eval_batch_size`), so `eval` on step N greedily reproduces the `eval/accuracy` the run logged at step N.

Greedy (the default): one answer per prompt; accuracy = share scoring exactly 1. With `--n K`: K samples per
prompt at `--temperature`, and pass@k for each k (default 1, 2, 4, ..., K) with the unbiased estimator
1 - C(n-c, k) / C(n, k) (Chen et al. 2021), averaged over prompts.

Writes `eval.json` (the metrics and settings) and `completions.jsonl` (every completion with its reward) to
`--out` (default: RUN_DIR/eval/step-N for a run, else eval/<model folder name>), and prints a table.

With an environment (`--env NAME [--tools calculator,python] [--max-turns N]`, or a run trained with `env.name`),
each prompt is played greedily to the end of its episode (jaxrl_llm/envs): the reward scores the final answer,
the table adds turns, tool calls per episode and the share of failed calls, and `completions.jsonl` holds whole
conversations, the model's turns (`assistant`) told apart from the environment's messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.cli.export import load_model
from jaxrl_llm.config import DataSection, load_run_config
from jaxrl_llm.data import build_prompt_set, load_records
from jaxrl_llm.engine import make_sampler
from jaxrl_llm.envs.sandbox import use_sandbox
from jaxrl_llm.errors import RunDirError, UsageError
from jaxrl_llm.evaluation import default_ks, generate_scored, summarize
from jaxrl_llm.rewards import resolve_reward
from jaxrl_llm.run.manifest import claim, unowned_existing
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.sampling.options import SAMPLERS
from jaxrl_llm.trainers.evaluation import EpisodeEvaluation, episode_metrics, eval_reward
from jaxrl_llm.trainers.policy import load_policy
from jaxrl_llm.trainers.trajectories import TrajectoryCollector

DEFAULT_MAX_NEW_TOKENS = 256


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jaxrl_llm eval", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF directory, hub id, RUN_DIR or RUN_DIR:STEP")
    parser.add_argument("--data", required=True, help="JSONL prompts (with the fields the reward reads)")
    parser.add_argument("--reward", default="", help="reward name or module:function (a run: its eval reward)")
    parser.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="one argmax answer per prompt (the default)")
    mode.add_argument("--n", type=int, default=0, help="K samples per prompt (pass@k)")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --n")
    parser.add_argument("--k", default="", help="comma-separated k of pass@k (default 1, 2, 4, ..., n)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="default: the run's, else 256")
    parser.add_argument("--limit", type=int, default=-1, help="first N prompts (default: a run's eval_size, else all)")
    parser.add_argument("--batch-size", type=int, default=0, help="prompts per batch (default: the run's, else 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=SAMPLERS, default=None,
                        help="the paged rollout engine or a static batch (docs/engine.md); default: a run's "
                             "sampling.engine, else paged")
    parser.add_argument("--out", default="", help="output folder for eval.json and completions.jsonl")
    parser.add_argument("--env", default=None, help="an environment (tool_use, module:function); a run: its own")
    parser.add_argument("--tools", default=None, help="comma-separated tools of the environment (calculator,python)")
    parser.add_argument("--max-turns", type=int, default=0, help="the model's turns per episode (default: 4)")
    args = parser.parse_args(argv)
    if args.env is not None and args.n:
        parser.error("--env plays each prompt once, greedily: drop --n")
    if args.n < 0 or (args.n == 0 and args.k):
        parser.error("--k needs --n K (K samples per prompt); --n must be >= 1")
    if args.n and args.temperature <= 0:
        parser.error(f"--temperature {args.temperature} must be > 0 with --n (use --greedy for argmax)")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.ks = [int(k) for k in args.k.split(",")] if args.k else []
    except ValueError:
        parser.error(f"--k {args.k!r} must be comma-separated whole numbers, e.g. 1,4,8")
    if any(not 1 <= k <= max(args.n, 1) for k in args.ks):
        parser.error(f"--k {args.k}: every k must be in 1..n ({args.n})")
    return args


def evaluate(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Path]:
    """The metrics, the completions (`Scored`, or episode rows) and the output folder of one `eval` command."""

    model = load_model(args.model)
    run = model.run
    c = run.config if run is not None else None
    if args.env or (args.env is None and c is not None and c.env.name):
        return evaluate_episodes(args, model)
    if args.reward:
        reward = (args.reward, resolve_reward(args.reward))
    elif c is not None and (c.eval_reward or c.rewards):

        reward = eval_reward(c)
    else:
        raise UsageError("--reward is required (a built-in like math_answer, or module:function)")
    # A run's prompt rendering and length filter (as its own evaluation); a HF directory: every prompt kept.
    data = dataclasses.replace(c.data) if c is not None else DataSection(max_prompt_tokens=1 << 30)
    if args.chat:
        data.chat_template = True
    # the run's own held-out set is loaded as the run loaded it (reasoning_gym: without the training problems)
    records, label = load_records(args.data, held_out_from=c.data.train if c is not None and args.data == c.data.eval
                                  else "")
    prompts = build_prompt_set(records, label, data, model.tokenizer)
    s = c.sampling if c is not None else None
    n = args.n or 1
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens or (s.max_new_tokens if s else DEFAULT_MAX_NEW_TOKENS),
        temperature=args.temperature if args.n else 1.0, top_k=s.top_k if s and args.n else 0,
        top_p=s.top_p if s and args.n else 1.0, min_p=s.min_p if s and args.n else 0.0, greedy=not args.n, n=n,
        eos_ids=model.eos_ids, pad_id=model.pad_id, prompt_bucket=s.prompt_bucket if s else 16,
        new_tokens_bucket=s.new_tokens_bucket if s else 16)
    limit = args.limit if args.limit >= 0 else (c.eval_size if c is not None else 0)
    batch_size = args.batch_size or (c.eval_batch_size if c is not None else 64)
    engine = args.engine or (s.engine if s is not None else "paged")
    knobs = {} if s is None else dict(page_size=s.engine_page_size, slots=s.engine_slots,
                                      steps_per_call=s.engine_steps_per_call, pages=s.engine_pages,
                                      attention=s.engine_attention)
    scored = generate_scored(model.params, model.model_config, model.tokenizer, prompts, reward, sampling,
                             batch_size=batch_size, limit=limit or None, key=jax.random.key(args.seed),
                             sampler=make_sampler(engine, model.model_config, **knobs))
    metrics = summarize(scored, args.ks or (default_ks(n) if args.n else []))
    metrics[f"reward/{reward[0]}/mean"] = metrics["reward/mean"]
    settings = {"model": args.model, "step": run.step if run else None, "data": args.data, "reward": reward[0],
                "greedy": not args.n, "n": n, "temperature": sampling.temperature if args.n else 0.0,
                "max_new_tokens": sampling.max_new_tokens, "limit": limit, "seed": args.seed, "engine": engine,
                "dropped_prompts": prompts.num_dropped}
    return {"metrics": metrics, "settings": settings}, scored, output_folder(args, run)


def evaluate_episodes(args: argparse.Namespace, model: Any) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    """`evaluate` with an environment: every prompt of `--data` played greedily to the end of its episode."""
    run = model.run
    base = run.config if run is not None else load_run_config(None, [f"model.path={args.model}",
                                                                     "data.max_prompt_tokens=1073741824"])
    env = dataclasses.replace(base.env, name=args.env or base.env.name,
                              tools=args.tools.split(",") if args.tools else base.env.tools,
                              max_turns=args.max_turns or base.env.max_turns)
    sampling = dataclasses.replace(base.sampling, max_new_tokens=args.max_new_tokens or base.sampling.max_new_tokens)
    data = dataclasses.replace(base.data, train=args.data, chat_template=base.data.chat_template or args.chat)
    config = dataclasses.replace(base, env=env, sampling=sampling, data=data,
                                 eval_reward=args.reward or base.eval_reward)
    use_sandbox(config.env.sandbox)  # the python tool: the run's sandbox mode, else bubblewrap
    policy = (dataclasses.replace(run.algorithm.policy, config=config) if run is not None
              else load_policy(config))
    evaluation = EpisodeEvaluation(TrajectoryCollector(policy), args.batch_size or config.eval_batch_size)
    # Without a reward function the environment's rewards are the whole return.
    evaluation.reward = eval_reward(config) if config.eval_reward or config.rewards else None
    name = evaluation.reward[0] if evaluation.reward else None
    prompts = policy.prompt_set(args.data, config.data.split)
    limit = args.limit if args.limit >= 0 else (config.eval_size if run is not None else 0)
    episodes, scores, texts = evaluation.play(model.params, prompts, limit or None)
    metrics = {k.removeprefix("eval/"): v for k, v in episode_metrics(episodes, scores, name).items()}
    metrics["prompts"] = float(len(episodes))
    rows = [{"prompt_index": i, "prompt": texts[i], "conversation": ep.conversation,
             "completion": ep.final_text, "reward": float(scores[i] + ep.env_reward), "env_reward": ep.env_reward,
             "turns": ep.turns, "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors}
            for i, ep in enumerate(episodes)]
    settings = {"model": args.model, "step": run.step if run else None, "data": args.data,
                "reward": name or "the environment's", "greedy": True, "n": 1, "temperature": 0.0, "env": env.name,
                "tools": list(env.tools), "max_turns": env.max_turns, "max_new_tokens": sampling.max_new_tokens,
                "limit": limit, "seed": args.seed, "dropped_prompts": prompts.num_dropped}
    return {"metrics": metrics, "settings": settings}, rows, output_folder(args, run)


def output_folder(args: argparse.Namespace, run: Any) -> Path:
    """`--out`, else the run's own eval/step-N (recorded as the run's), else eval/<model folder name>."""
    if args.out:
        return Path(args.out)
    if run is None:
        return Path("eval") / Path(args.model.rstrip("/")).name
    if unowned_existing(run.run_dir, run.run_dir / "eval"):
        raise RunDirError(f"{run.run_dir / 'eval'} was not written by the run in {run.run_dir} (it was there "
                          f"before): left alone; choose another folder with --out")
    out = run.run_dir / "eval" / f"step-{run.step}"
    claim(run.run_dir, out)
    return out


def table(result: dict[str, Any]) -> str:
    """The readable table `eval` prints."""
    s = result["settings"]
    mode = "greedy" if s["greedy"] else f"{s['n']} samples/prompt at temperature {s['temperature']:g}"
    where = f"{s['model']}" + (f" (checkpoint step {s['step']})" if s["step"] is not None else "")
    lines = [f"{where} on {s['data']}: {int(result['metrics']['prompts'])} prompts, {mode}, reward {s['reward']}"]
    width = max(len(k) for k in result["metrics"])
    for key, value in result["metrics"].items():
        if key in ("prompts", "samples_per_prompt") or key.startswith(f"reward/{s['reward']}/"):
            continue
        lines.append(f"  {key:<{width}}  {value:.4f}" if key != "completion_length/mean" else
                     f"  {key:<{width}}  {value:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result, scored, out = evaluate(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = scored if isinstance(scored, list) else scored.rows()
    (out / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(result))
    print(f"wrote {out / 'eval.json'} and {out / 'completions.jsonl'}")
    return 0

