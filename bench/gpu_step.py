"""One GRPO step on an accelerator: sampler tokens/s and the train step's model FLOPs utilisation (MFU).

    python bench/gpu_step.py                        # Qwen2.5-0.5B-shaped, random weights, bfloat16 compute
    python bench/gpu_step.py --peak-tflops 989      # the device's dense bf16 peak (H100/H200 SXM: 989)
    python bench/gpu_step.py --tiny                 # a seconds-long smoke run of the same code (CPU is fine)

The model is built from a config alone (`config_from_hf` + `init_params`: no download, random weights):
by default Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads of 64, SwiGLU 4864, vocab
151936, tied embeddings, q/k/v biases; 494M parameters), parameters in float32, compute in bfloat16, on a
`(data, fsdp, tensor)` mesh over all devices (`--mesh`).

One step = `--prompts` x `--group` completions of exactly `--new-tokens` tokens (no EOS ids, so every row
makes every token) from `--prompt-len`-token prompts, then one `train_step` (clipped loss with a k3 KL term,
AdamW) over all of them. Reported:
- sampler: generated tokens / wall seconds of one jitted sampling call (prefill included), compile apart;
- train step: model FLOPs / wall seconds / (`--peak-tflops` x devices). Model FLOPs per row of `S` positions
  (`S = prompt + new - 1`, completions unembedded only): forward `2 N_layers S + 2 d V c + 4 L H hd S(S+1)/2`
  (`N_layers` = the layers' matrix parameters, `c` completion tokens), training = 3 x forward.
Prints one JSON line at the end (for bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import QWEN25_05B, QWEN25_05B_TINY, add_int_options, model_dims, train_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_int_options(parser, {"--prompts": 16, "--group": 8, "--prompt-len": 128, "--new-tokens": 256})
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--mesh", default="data=-1,fsdp=1,tensor=1")
    parser.add_argument("--remat", action="store_true")
    add_int_options(parser, {"--steps": 3})
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per device, dense, compute dtype")
    parser.add_argument("--tiny", action="store_true")
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """`(mesh, config, param_shardings, params)`: the random model placed on the `--mesh`."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.sharding import MeshShape, make_mesh, param_shardings

    sizes = dict(kv.split("=") for kv in args.mesh.split(","))
    mesh = make_mesh(MeshShape(int(sizes["data"]), int(sizes["fsdp"]), int(sizes["tensor"])))
    config = config_from_hf(QWEN25_05B_TINY if args.tiny else QWEN25_05B, dtype=args.dtype, remat=args.remat)
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    shardings = param_shardings(shapes, mesh)
    params = jax.jit(lambda: init_params(config, jax.random.key(0)), out_shardings=shardings)()
    print(f"{config.num_params() / 1e6:.1f}M params, {jax.device_count()} x {jax.devices()[0].device_kind}, "
          f"mesh {dict(mesh.shape)}, compute {args.dtype}, jax {jax.__version__}, {platform.node()}", flush=True)
    return mesh, config, shardings, params


def time_sampler(args: argparse.Namespace, mesh: Any, config: Any, params: Any,
                 prompts: np.ndarray) -> tuple[Any, float]:
    """The last sampling call's output and the sampler's tokens/s (best of `--steps` calls, compile apart)."""
    from jaxrl_llm.sampling import SamplingConfig, compile_sampler

    mask = np.ones_like(prompts)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0, n=args.group, eos_ids=(), pad_id=0,
                              prompt_bucket=args.prompt_len, new_tokens_bucket=args.new_tokens)
    start = time.perf_counter()
    run = compile_sampler(params, config, prompts, mask, jax.random.key(0), sampling, mesh=mesh)
    sample_compile = time.perf_counter() - start
    sample_times = []
    for i in range(args.steps):
        start = time.perf_counter()
        out = run(params, prompts, mask, jax.random.key(i))
        jax.block_until_ready(out.tokens)
        sample_times.append(time.perf_counter() - start)
    rows = args.prompts * args.group
    tokens_per_s = rows * args.new_tokens / min(sample_times)
    print(f"sampler: {tokens_per_s:.0f} tokens/s (best of {args.steps}: {min(sample_times):.3f} s for {rows} x "
          f"{args.new_tokens}; compile {sample_compile:.1f} s)", flush=True)
    return out, tokens_per_s


def time_train_step(args: argparse.Namespace, mesh: Any, config: Any, shardings: Any, params: Any, batch: Any,
                    ) -> tuple[float, float, Any]:
    """`(best seconds of --steps train steps, the first call's seconds (compile included), metrics)`."""
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.optim import make_optimizer
    from jaxrl_llm.sharding import init_optimizer_state
    from jaxrl_llm.trainers.objectives import PolicyObjective, policy_loss
    from jaxrl_llm.trainers.step import jit_one_step_update, state_sharding

    optimizer, _ = make_optimizer(OptimSection(learning_rate=1e-6), 100)
    opt_state = init_optimizer_state(optimizer, params, shardings, mesh)
    state = {"params": params, "opt_state": opt_state}
    update = jit_one_step_update(mesh, state_sharding(state), loss_fn=policy_loss, model_config=config,
                                 optimizer=optimizer, loss_config=PolicyObjective(beta=0.04, max_len=args.new_tokens),
                                 grad_accum=1)
    key = jax.random.key(0)
    start = time.perf_counter()
    state, metrics = update(state, batch, key, None)
    jax.block_until_ready(metrics)
    step_compile = time.perf_counter() - start
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = update(state, batch, key, None)
        jax.block_until_ready(metrics)
        step_times.append(time.perf_counter() - start)
    return min(step_times), step_compile, metrics


def main() -> None:
    args = parse_args()
    from jaxrl_llm.models.sequences import Sequences
    from jaxrl_llm.sharding import global_array
    from jaxrl_llm.trainers.objectives import PolicyBatch

    mesh, config, shardings, params = build_model(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(prompts)
    out, tokens_per_s = time_sampler(args, mesh, config, params, prompts)
    rows = args.prompts * args.group
    old = np.asarray(out.logprobs_untruncated, np.float32)
    sequences = Sequences(np.repeat(prompts, args.group, 0), np.repeat(mask, args.group, 0), np.asarray(out.tokens),
                          np.asarray(out.mask))
    batch = PolicyBatch(sequences, old, old, rng.normal(size=rows).astype(np.float32))
    batch = jax.tree.map(lambda x: global_array(x, mesh), batch)
    step_s, step_compile, metrics = time_train_step(args, mesh, config, shardings, params, batch)
    flops = train_flops(model_dims(config), rows, args.prompt_len, args.new_tokens)
    mfu = flops / step_s / (args.peak_tflops * 1e12 * jax.device_count())
    print(f"train step: {step_s:.3f} s (best of {args.steps}; first call incl. compile {step_compile:.1f} s),"
          f" {flops / 1e12:.2f} TFLOP, MFU {mfu:.3f} of {args.peak_tflops:.0f} TFLOP/s x {jax.device_count()}; "
          f"loss {float(metrics['loss']):.4f}", flush=True)
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "params_m": round(config.num_params() / 1e6, 1), "dtype": args.dtype, "mesh": dict(mesh.shape),
        "rows": rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "sampler_tokens_per_s": round(tokens_per_s), "train_step_s": round(step_s, 4),
        "train_tflop": round(flops / 1e12, 3), "mfu": round(mfu, 4),
        "finite": bool(jnp.isfinite(metrics["loss"])),
    }))


if __name__ == "__main__":
    main()
