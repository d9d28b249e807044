"""Where a decode step of the rollout engine's CPU path goes: the whole step beside its phases, at one shape.

    python bench/decode_phases.py [--model DIR] [--slots 128] [--context 384] [--steps 16] [--repeats 3]
                                  [--page-size 0]
                                  [--dtype bfloat16] [--attention auto|xla|cpu] [--matmul auto|xla]

The step is `engine/model.py: kernel_decode_step` (the C++ kernel over the pages) or `slot_decode_step` (the XLA
path) and the sampling of `engine/programs.py` (temperature 1.0, each row's own uniform), `--steps` steps in one
jitted loop (as a decode call runs them), every one of `--slots` slots active, each holding a context of `--context`
positions (no pages shared between slots). `--matmul auto`: the matmuls as the engine runs them (on the CPU kernel
with a bfloat16 model and AMX, on weights packed once: `cpu_kernel.packed_matmul`); `xla`: XLA's dots. The pool is
donated to each call, as the engine's decode program donates it (no copy of it per call).
The phases, each timed alone in a loop of the same steps:

- `step without attention`: the same step with attention replaced by the identity on the queries (the matmuls,
  norms, RoPE, the MLP's activation and the unembedding);
- `attention`: each layer's write of the new token and the attention over the context: `--attention xla` (the
  engine's XLA path: contiguous per-call caches, `loop_layout_attention`), `cpu` (the C++ kernel straight over the
  pages, `engine/cpu_kernel.py`; each slot's context in its own pages) or `auto` (the engine's choice here); the
  whole step uses the same;
- `sampling`: each row's uniform and the draw over the logits `[slots, vocab]` (on the CPU kernel's path the C++
  inverse-CDF kernel, `cpu_kernel.inverse_cdf_sample`, as the engine; else `sample_with_uniform`).

The step takes its rotary tables from one table per call (`engine/model.py: call_rotary`), as the engine does.

Printed: ms per step of each, its share of the whole step, tokens/s at this shape, and the matmuls' FLOP/s
(2 x parameters x slots per step, attention excluded). Defaults: the RL shape of `rollout_engine.py` at its
busiest (128 rows, about 140 prompt + 244 sampled positions) on SmolLM2-135M-Instruct (`../shared`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_int_options, best_seconds  # noqa: E402
from jaxrl_llm.engine import cpu_kernel  # noqa: E402
from jaxrl_llm.engine.kernels import attention_backend  # noqa: E402
from jaxrl_llm.engine.model import (  # noqa: E402
    PackedWeights,
    call_rotary,
    kernel_attention,
    kernel_decode_step,
    layer_inputs,
    packed_logits,
    packed_step_ops,
    paged_logits,
    slot_attention,
    slot_decode_step,
    step_rotary,
)
from jaxrl_llm.engine.pages import default_page_size, page_slots, storage_dtype  # noqa: E402
from jaxrl_llm.engine.programs import pack_weights, prepare_weights, row_uniforms  # noqa: E402
from jaxrl_llm.models.block import transformer_block  # noqa: E402
from jaxrl_llm.models.hf import load_hf_model  # noqa: E402
from jaxrl_llm.models.layers import embed_tokens, rms_norm  # noqa: E402
from jaxrl_llm.models.step_weights import step_ops  # noqa: E402
from jaxrl_llm.sampling.config import Knobs  # noqa: E402
from jaxrl_llm.sampling.logits import sample_with_uniform  # noqa: E402

SMOLLM2 = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "hf"
KNOBS = Knobs(np.float32(1.0), np.int32(0), np.float32(1.0), np.float32(0.0), np.int32(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    add_int_options(parser, {"--slots": 128, "--context": 384, "--steps": 16})
    parser.add_argument("--page-size", type=int, default=0, help="0: the engine's default (engine.pages)")
    add_int_options(parser, {"--repeats": 3})
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--attention", default="auto", choices=("auto", "xla", "cpu"))
    parser.add_argument("--matmul", default="auto", choices=("auto", "xla"))
    args = parser.parse_args()

    config, params = load_hf_model(args.model, dtype=args.dtype)
    backend = attention_backend(config, args.attention, "cpu")
    c, s, ctx = config, args.slots, args.context
    weights = prepare_weights(params, config)
    packed = (args.matmul == "auto" and backend == "cpu" and config.jnp_dtype == jnp.bfloat16
              and cpu_kernel.packed_matmul_unavailable_reason() is None)
    step_weights: list | PackedWeights = pack_weights(params, weights, config=config) if packed else weights
    layers = step_weights.layers if packed else weights
    rng = np.random.default_rng(0)
    stored = storage_dtype(c.jnp_dtype)

    def cache(shape: tuple[int, ...]) -> jax.Array:
        values = jnp.asarray(rng.standard_normal(shape) * 0.5, c.jnp_dtype)
        return jax.lax.bitcast_convert_type(values, stored) if stored == jnp.uint16 else values

    kvh, hd, ps = c.num_kv_heads, c.head_dim, args.page_size or default_page_size()
    if backend == "xla":  # the call's contiguous caches
        caches = [{"k": cache((s, kvh, hd, ctx)), "v": cache((s, kvh, ctx, hd))} for _ in range(c.num_layers)]
    else:  # the pool: each slot's context in its own pages, scattered
        width = -(-ctx // ps)
        caches = [{"k": cache((kvh, s * width + 1, ps, hd)), "v": cache((kvh, s * width + 1, ps, hd))}
                  for _ in range(c.num_layers)]
        table = jnp.asarray(rng.permutation(s * width).reshape(s, width), jnp.int32)
    start = jnp.asarray(rng.integers(ctx // 2, ctx - args.steps, s), jnp.int32)  # each slot's position
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, s), jnp.int32)
    key_data = jax.random.key_data(jax.random.split(jax.random.key(0), s))

    kernel_sampling = backend == "cpu" and cpu_kernel.sampling_unavailable_reason() is None

    def sample(logits: jax.Array, j: jax.Array) -> jax.Array:
        uniform = row_uniforms(key_data, jnp.full((s,), j))
        if kernel_sampling:  # as the engine's decode program draws on the CPU
            return cpu_kernel.inverse_cdf_sample(logits, uniform, KNOBS.temperature)[0]
        return sample_with_uniform(logits, uniform, KNOBS, greedy=False)[0]

    def whole(caches: list, tokens: jax.Array) -> jax.Array:
        rotary = call_rotary(c, start, args.steps)  # once per call, as the engine's decode program

        def body(j: jax.Array, carry: tuple) -> tuple:
            token, caches = carry
            if backend == "xla":
                logits, caches, _ = slot_decode_step(params, weights, c, token, start + j, caches)
            else:
                logits, caches, _ = kernel_decode_step(params, step_weights, c, token, start + j, table, caches,
                                                       backend, rotary=step_rotary(rotary, j))
            return sample(logits, j), caches
        return jax.lax.fori_loop(0, args.steps, body, (tokens, caches))

    def no_attention(tokens: jax.Array) -> jax.Array:
        rotary = call_rotary(c, start, args.steps)

        def body(j: jax.Array, token: jax.Array) -> jax.Array:
            inputs = step_rotary(rotary, j)
            x = embed_tokens(params["embed"]["embedding"], token[:, None], c)
            for i, w in enumerate(layers):
                cos, sin = inputs[c.is_sliding(i)]
                ops = packed_step_ops(w, c) if packed else step_ops(w, c)
                x, _, _ = transformer_block(x, ops, lambda q, k, v, sinks: (q.reshape(s, 1, -1), None), cos, sin, c)
            if packed:  # the final norm in the head's kernel, as the engine's step
                logits = packed_logits(step_weights.head, c, x[:, 0], params["final_norm"]["scale"])
            else:
                hidden = rms_norm(x[:, 0], params["final_norm"]["scale"], c.rms_norm_eps,
                                  unit_offset=c.norm_unit_offset)
                logits = paged_logits(params, c, hidden)
            # the next token from one column, not a pass over [S, V] (an argmax there cost 9 ms at 128 rows); a
            # column chosen at run time, so XLA cannot shrink the unembedding to it
            column = jax.lax.dynamic_index_in_dim(logits, j % c.vocab_size, axis=1, keepdims=False)
            return (jnp.abs(column) * 1000).astype(jnp.int32) % c.vocab_size
        return jax.lax.fori_loop(0, args.steps, body, tokens)

    q_shape, kv_shape = (s, 1, c.num_heads, hd), (s, 1, kvh, hd)
    q0, k0 = (jnp.asarray(rng.standard_normal(x), c.jnp_dtype) for x in (q_shape, kv_shape))

    def attention(caches: list, q: jax.Array) -> jax.Array:
        def body(j: jax.Array, carry: tuple) -> tuple:
            q, caches = carry
            position = start + j
            allowed = layer_inputs(c, position[:, None], ctx)[False][2]
            slots = page_slots(table, position[:, None], ps, s * width + 1) if backend != "xla" else None
            new = []
            for cache_ in caches:
                if backend == "xla":
                    out, cache_ = slot_attention(c, cache_, position, allowed)(q, k0, k0, None)
                else:
                    out, cache_ = kernel_attention(c, cache_, table, slots, position + 1, backend)(q, k0, k0, None)
                q = out.reshape(q_shape).astype(c.jnp_dtype)
                new.append(cache_)
            return q, new
        return jax.lax.fori_loop(0, args.steps, body, (q, caches))

    logits0 = jnp.asarray(rng.standard_normal((s, c.vocab_size)), jnp.float32)

    def sampling(logits: jax.Array) -> jax.Array:
        def body(j: jax.Array, carry: tuple) -> tuple:
            logits, acc = carry
            token = sample(logits, j)
            return logits + token[:, None].astype(jnp.float32) * 1e-9, acc + token
        return jax.lax.fori_loop(0, args.steps, body, (logits, jnp.zeros((s,), jnp.int32)))[1]

    pool = [caches]  # donated to each call and taken back from its result, as the engine does

    def with_pool(fn: object) -> object:
        jitted = jax.jit(fn, donate_argnums=0)

        def call(x: jax.Array) -> jax.Array:
            out, pool[0] = jitted(pool[0], x)
            return out
        return call

    phases = {"whole step": (with_pool(whole), (tokens,)),
              "step without attention": (jax.jit(no_attention), (tokens,)),
              "attention": (with_pool(attention), (q0,)),
              "sampling": (jax.jit(sampling), (logits0,))}
    print(f"{Path(args.model).name} {args.dtype}: {s} slots, context {ctx}, {args.steps} steps per call, "
          f"pages of {ps}, attention {backend}, matmuls {'AMX, packed' if packed else 'XLA'}, jax {jax.__version__}")
    print("| phase | ms / step | share of the step |")
    print("| --- | ---: | ---: |")
    ms = {}
    for name, (fn, inputs) in phases.items():
        jax.block_until_ready(fn(*inputs))  # compiles
        ms[name] = best_seconds(lambda fn=fn, inputs=inputs: jax.block_until_ready(fn(*inputs)),
                                args.repeats) / args.steps * 1e3
        print(f"| {name} | {ms[name]:.2f} | {ms[name] / ms['whole step']:.0%} |", flush=True)
    rest = ms["whole step"] - ms["step without attention"] - ms["attention"] - ms["sampling"]
    print(f"| the rest (whole minus the three) | {rest:.2f} | {rest / ms['whole step']:.0%} |")
    flops = 2 * c.num_params() * s
    print(f"tokens/s at this shape: {s / ms['whole step'] * 1e3:.0f}; the step without attention alone: "
          f"{s / ms['step without attention'] * 1e3:.0f} ({flops / ms['step without attention'] / 1e6:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
