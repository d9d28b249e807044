"""Sampler throughput: jaxrl_llm.sampling.sample vs transformers' `generate` (torch CPU), same model and batch.

    python bench/sampling.py [--batch 32] [--prompt-len 32] [--new-tokens 64] [--repeats 5] [--threads N]
                             [--cpu-devices D] [--model DIR] [--dtype float32|bfloat16]

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
a jitted `fori_loop`; no attention, norms, cache writes or sampling), plus a prefill-only call (the sampler
with one new token). `HF time / (floor + prefill)` is the ratio the sampler would reach if everything in its
loop but the matmuls cost nothing: an upper bound for this machine and XLA:CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Benchmark this checkout's `jaxrl_llm`, not whichever copy is installed (an editable install may point to
# another clone: `python bench/sampling.py` puts only `bench/` on the path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import QWEN2_VOCAB8K_10M, jax_matmul_flops, model_dims, random_hf_model, sampling_flops  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Which number is larger, 47 or 62?",
    "Explain why the sky is blue.", "Give me three tips for learning to cook.", "What is 12 + 35?",
    "Describe a cat in one sentence.", "How do plants make their food?", "Name a famous painter and a painting.",
    "Why do we need sleep?", "Tell me a fun fact about space.", "What is a prime number?",
]


def chat_prompts(model_dir: str, batch: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`batch` chat questions rendered with the model's tokenizer (chat template when it has one), left-padded:
    `(tokens, mask, pad_id, eos_id)`."""
    from jaxrl_llm.data import left_pad, load_tokenizer

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


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_matmul_floor(params, config, batch: int, steps: int, repeats: int = 5) -> float:
    """Best wall time of `steps` token steps that run only the decode loop's matmuls (the sampler's own
    `StepWeights` and output matrix, `batch` rows): see the module docstring."""
    from jaxrl_llm.models.decode import split_layers, step_weights

    weights = step_weights(split_layers(params, config), config)
    output = params["embed"]["embedding"] if config.tie_word_embeddings else params["lm_head"]["kernel"].T
    d, q = config.hidden_size, config.num_heads * config.head_dim

    def token_step(_, x):
        for w in weights:
            qkv = x @ w.qkv
            x = x + qkv[:, :q] @ w.o
            gate_up = x @ w.gate_up
            x = x + gate_up[:, : config.intermediate_size] @ w.down
        logits = x @ output.T
        return x + 1e-3 * logits[:, :d]  # keeps every product live and the steps dependent

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, token_step, x))
    x = jnp.ones((batch, d), config.jnp_dtype)
    loop(x).block_until_ready()
    return min(_timed(lambda: loop(x).block_until_ready()) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--cpu-devices", type=int, default=1, help="XLA CPU devices to split the batch over")
    parser.add_argument("--model", default="", help="a HF model directory (default: a random 10M Qwen2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if args.cpu_devices > 1:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before the first use of a device

    import torch

    import jaxrl_llm
    from jaxrl_llm.models.hf import load_hf_model
    from jaxrl_llm.sampling import SamplingConfig, compile_sampler
    from jaxrl_llm.sharding import MeshShape, make_mesh, shard_params

    torch.set_num_threads(args.threads)
    tokens_made = args.batch * args.new_tokens
    pad_id, eos_id = 0, 1
    if args.model:
        from transformers import AutoModelForCausalLM

        prompts, mask, pad_id, eos_id = chat_prompts(args.model, args.batch)
        args.prompt_len = prompts.shape[1]
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        config, params = load_hf_model(args.model, dtype=args.dtype, param_dtype=args.dtype)
        name = f"{args.model} ({config.model_type})"
    else:
        rng = np.random.default_rng(0)
        prompts = rng.integers(1, QWEN2_VOCAB8K_10M["vocab_size"], (args.batch, args.prompt_len)).astype(np.int32)
        mask = np.ones_like(prompts)
        with tempfile.TemporaryDirectory() as model_dir:
            hf = random_hf_model(QWEN2_VOCAB8K_10M, out_dir=model_dir)
            config, params = load_hf_model(model_dir, dtype=args.dtype, param_dtype=args.dtype)
        name = "Qwen2-shaped random"
    if args.dtype == "bfloat16":
        hf = hf.to(torch.bfloat16)

    print(f"model: {name}, {config.num_params() / 1e6:.2f}M parameters, vocab {config.vocab_size}, "
          f"{config.num_layers} layers, hidden {config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads}")
    print(f"batch {args.batch}, prompt {args.prompt_len} (padding {int((mask == 0).sum())} of "
          f"{mask.size} positions), new tokens {args.new_tokens} (sampled, T=1.0), {args.dtype}, "
          f"{args.threads} CPU threads, jax {jax.__version__} {jax.devices()[0].platform}, torch {torch.__version__}")
    print(f"jaxrl_llm from {Path(jaxrl_llm.__file__).parent}")

    # ---- ours
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, prompt_bucket=args.prompt_len,
                              new_tokens_bucket=args.new_tokens)
    mesh = None
    if args.cpu_devices > 1:
        mesh = make_mesh(MeshShape(data=args.cpu_devices, fsdp=1, tensor=1))
        whole = compile_sampler(params, config, prompts, mask, jax.random.key(0), sampling)(
            params, prompts, mask, jax.random.key(3))
        params = shard_params(params, mesh)
        print(f"sampling on a data={args.cpu_devices} mesh of CPU devices: {mesh.devices.ravel().tolist()}")
    start = time.perf_counter()
    run = compile_sampler(params, config, prompts, mask, jax.random.key(0), sampling, mesh=mesh)
    compile_s = time.perf_counter() - start
    if mesh is not None:
        split = run(params, prompts, mask, jax.random.key(3))
        assert np.array_equal(np.asarray(split.tokens), np.asarray(whole.tokens)), "mesh changed the tokens"
    calls = iter(range(10**6))

    def ours() -> None:
        out = run(params, prompts, mask, jax.random.key(next(calls)))
        out.tokens.block_until_ready()
        assert int(out.lengths.sum()) == tokens_made

    # ---- transformers
    input_ids, attention_mask = torch.tensor(prompts, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def theirs() -> None:
        with torch.no_grad():
            out = hf.generate(input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_k=None,
                              top_p=None, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              pad_token_id=pad_id, eos_token_id=eos_id)
        assert out.shape == (args.batch, args.prompt_len + args.new_tokens)

    # Warm up both, then alternate the timed runs so a change in machine load hits both sides alike.
    ours()
    theirs()
    timings: dict[str, list[tuple[float, float]]] = {"ours": [], "hf": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("hf", theirs)):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            timings[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    (ours_s, ours_cpu), (hf_s, hf_cpu) = (min(timings[name]) for name in ("ours", "hf"))

    ours_tok_s, hf_tok_s = tokens_made / ours_s, tokens_made / hf_s
    limit = jax_matmul_flops(dtype=args.dtype, repeats=20)
    achieved = sampling_flops(model_dims(config), args.batch, args.prompt_len, args.new_tokens) / ours_s
    print(f"jaxrl_llm sample     : {ours_tok_s:9.0f} tokens/s  ({ours_s * 1e3:7.1f} ms per call, "
          f"{ours_cpu * 1e3:7.1f} ms CPU; compile {compile_s:.2f} s, apart)")
    print(f"transformers generate: {hf_tok_s:9.0f} tokens/s  ({hf_s * 1e3:7.1f} ms per call, "
          f"{hf_cpu * 1e3:7.1f} ms CPU)")
    print(f"ratio = ours_tok_s / hf_tok_s = {ours_tok_s / hf_tok_s:.2f}")
    print(f"model FLOP/s: {achieved / 1e9:.1f} GFLOP/s = {achieved / limit:.2f} of a jitted {args.dtype} 1024^3 matmul "
          f"({limit / 1e9:.1f} GFLOP/s, same run)")
    if mesh is None:
        floor_s = decode_matmul_floor(params, config, args.batch, args.new_tokens - 1)
        one_token = dataclasses.replace(sampling, max_new_tokens=1, new_tokens_bucket=1)
        prefill = compile_sampler(params, config, prompts, mask, jax.random.key(0), one_token)
        prefill_s = min(_timed(lambda: prefill(params, prompts, mask, jax.random.key(0)).tokens.block_until_ready())
                        for _ in range(args.repeats))
        print(f"decode-loop floor (its matmuls alone): {floor_s * 1e3:.1f} ms; prefill-only call: "
              f"{prefill_s * 1e3:.1f} ms; ceiling ratio with the rest of the loop free: "
              f"{hf_s / (floor_s + prefill_s):.2f}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"1-minute load average at the end: {load:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
