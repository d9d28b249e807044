"""Compiled memory of one GRPO train step, by compiling only (no weights, no run), next to the planner's figure.

    python bench/memory_step.py                      # the GSM8K preset's micro-batch, Qwen2.5-0.5B shapes
    python bench/memory_step.py --model DIR --micro-batch 8 --prompt-len 64 --new-tokens 128

Shapes default to `configs/grpo_gsm8k_qwen2.5-0.5b.yaml`: minibatch 128 in 4 accumulation steps (micro-batch 32),
256 prompt + 512 completion tokens, bf16 compute over float32 parameters, remat, a KL term. The step is lowered
with abstract arguments (`jax.ShapeDtypeStruct`), compiled for this machine's backend, and XLA's
`compiled.memory_analysis()` is read: arguments (params, AdamW state, the batch) + temporaries + outputs not
aliased to donated arguments. On CPU this is the figure the issue asks for; a GPU compiles its own buffers.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

QWEN25_05B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}
GIB = 1024**3
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF directory or config.json (default: Qwen2.5-0.5B's config)")
    parser.add_argument("--micro-batch", type=int, default=32, help="sequences per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--no-remat", action="store_true")
    parser.add_argument("--remat-policy", default="full", choices=("full", "matmuls"),
                        help="model.remat_policy: what a rematerialised layer keeps for its backward pass")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--logprob-block-mib", type=float, default=256.0,
                        help="model.logprob_block_mib: one float32 logits block; 0 = all positions in one block")
    parser.add_argument("--attention-query-chunk", type=int, default=64,
                        help="model.attention_query_chunk (the GSM8K preset's 64); 0 = all queries at once")
    args = parser.parse_args()

    from jaxrl_llm.cli import plan
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.models.decoder import param_shapes
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.models.sequences import Sequences
    from jaxrl_llm.optim import make_optimizer
    from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss
    from jaxrl_llm.trainers.step import train_step

    hf = plan.load_hf_config_dict(args.model) if args.model else QWEN25_05B
    config = config_from_hf(hf, dtype=args.dtype, param_dtype="float32", remat=not args.no_remat,
                            remat_policy=args.remat_policy, attention_query_chunk=args.attention_query_chunk)
    rows = args.micro_batch * args.grad_accum
    optimizer = make_optimizer(OptimSection(learning_rate=1e-6), 100)[0]
    shapes = param_shapes(config)
    ints = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.int32)  # noqa: E731
    floats = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.float32)  # noqa: E731
    batch = PolicyBatch(Sequences(ints(args.prompt_len), ints(args.prompt_len), ints(args.new_tokens),
                                  ints(args.new_tokens)),
                        floats(args.new_tokens), floats(args.new_tokens), jax.ShapeDtypeStruct((rows,), jnp.float32))
    loss_config = PolicyObjective(beta=args.beta, max_len=args.new_tokens, logprob_block_mib=args.logprob_block_mib)
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config, loss_config=loss_config,
                             optimizer=optimizer, grad_accum=args.grad_accum)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        shapes, jax.eval_shape(optimizer.init, shapes), batch).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    p = plan.plan_memory(config, (1, 1, 1), batch=rows, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                         grad_accum=args.grad_accum, reference=False, logprob_block_mib=args.logprob_block_mib)
    planned = p.train_step
    print(f"{config.num_params() / 1e6:.1f}M params, vocab {config.vocab_size}; micro-batch {args.micro_batch} x "
          f"{args.grad_accum}, {args.prompt_len}+{args.new_tokens} tokens, compute {args.dtype}, "
          f"remat {'off' if args.no_remat else args.remat_policy}, logprob block {args.logprob_block_mib} MiB, "
          f"attention query chunk {config.attention_query_chunk}; "
          f"compiled in {seconds:.0f} s on {jax.devices()[0].platform}")
    print(f"compiled: arguments {m.argument_size_in_bytes / GIB:.2f} GiB + temporaries {m.temp_size_in_bytes / GIB:.2f}"
          f" GiB + outputs {m.output_size_in_bytes / GIB:.2f} GiB - aliased {m.alias_size_in_bytes / GIB:.2f} GiB"
          f" = {total / GIB:.2f} GiB")
    print(f"planner (python -m jaxrl_llm plan, 'train step program alone'): params {p.params / GIB:.2f} + optimizer "
          f"{p.optimizer / GIB:.2f} + batch {p.batch / GIB:.2f} + {p.gradient_buffers} x gradients "
          f"{p.gradients / GIB:.2f} + activations {p.activations / GIB:.2f} = {planned / GIB:.2f} GiB "
          f"(planned / compiled = {planned / total:.3f})")
    print(json.dumps({"compiled_gib": round(total / GIB, 3), "temp_gib": round(m.temp_size_in_bytes / GIB, 3),
                      "argument_gib": round(m.argument_size_in_bytes / GIB, 3),
                      "planned_gib": round(planned / GIB, 3)}))


if __name__ == "__main__":
    main()
