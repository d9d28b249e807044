"""Long contexts: the update's compiled memory and time per token as the context grows, the dense-mask attention the
trainer had beside the attention seam it has now, and with the `sequence` axis (memory per device).

    python bench/long_context.py                                  # SmolLM2-135M, contexts 2k ... 32k
    python bench/long_context.py --contexts 2048,4096 --time-up-to 4096 --sequence 1,2,4
    python bench/long_context.py --model DIR --paths seam

One sequence per update, packed (`rl.packing`: one row of `context` tokens, a 16-token prompt and the rest its
completion), the GRPO train step as the trainer runs it (`train_step` with `policy_loss`: forward, backward, AdamW),
bfloat16 compute over float32 weights, remat, queries in chunks of `--query-chunk`, log-probs in blocks of 256 MiB
(`model.logprob_block_mib`'s default). For each context:
- `dense`: the attention before the seam: the dense `[B, T, T]` boolean mask of the packed rows, then causal query
  chunks over the keys before them (`dense_attention` here), patched into the model for this bench;
- `seam`: `models.attention` (the XLA path on a CPU): the mask as segment ids, built per query chunk;
- `seam, sequence = N` (`--sequence`): the seam on a mesh of N virtual CPU devices with `mesh.sequence = N`.

Compiled memory is XLA's `memory_analysis()` of the compiled update (arguments + temporaries + outputs not aliased
to the donated state), per device; the update is only compiled, not run, except at contexts up to `--time-up-to`
on one device, where two updates run and the second is timed (time per token = its seconds / context).
The weights are random (the shapes are the model's: `config.json` is all that is read).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1024**3
PROMPT = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="../shared/models/smollm2-135m-instruct/hf",
                        help="an HF model directory or config.json (only the config is read)")
    parser.add_argument("--contexts", default="2048,4096,8192,16384,32768")
    parser.add_argument("--paths", default="dense,seam")
    parser.add_argument("--sequence", default="1,2,4", help="sequence-axis sizes for the seam (virtual devices)")
    parser.add_argument("--time-up-to", type=int, default=4096, help="run (not only compile) contexts up to this")
    parser.add_argument("--query-chunk", type=int, default=512, help="model.attention_query_chunk")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-remat", action="store_true")
    return parser.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    devices = max(int(n) for n in ARGS.sequence.split(","))
    if devices > 1:  # before JAX starts: the sequence axis's virtual devices
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import cpu_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, spec: Any, *, sinks: Any = None,
                    backend: str = "xla", query_chunk: int = 0, compute_dtype: Any = jnp.float32,
                    block: Any = None) -> jax.Array:
    """The attention before the seam: the dense `[B, T, T]` boolean mask of packed rows (block-diagonal causal,
    the window) built once, then causal query chunks `[a, b)` over keys `[0, b)`, each under `jax.checkpoint`."""
    from jaxrl_llm.models.layers import attention_block

    segments, t = mask.kv_segments, q.shape[1]
    idx = jnp.arange(t)
    allowed = idx[None, :] <= idx[:, None]
    if spec.window is not None:
        allowed &= idx[:, None] - idx[None, :] < spec.window
    allowed = allowed[None] & (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale

    def part(a: int, b: int) -> jax.Array:
        return attention_block(q[:, a:b], k[:, :b], v[:, :b], allowed[:, a:b, :b], scale, spec.softcap,
                               compute_dtype, sinks)

    chunk = query_chunk or t
    return jnp.concatenate([jax.checkpoint(functools.partial(part, a, min(a + chunk, t)))()
                            for a in range(0, t, chunk)], axis=1)


def update_program(config: Any, context: int, sequence: int = 1) -> tuple[Any, tuple[Any, ...], Any]:
    """`(jitted update, its arguments as ShapeDtypeStructs, the packed layout)`: one packed sequence of `context`
    tokens; with `sequence > 1` on a mesh of that many devices' `sequence` axis (everything else replicated: the
    model splits the positions, `ModelConfig.sequence_mesh`)."""
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.models.decoder import param_shapes
    from jaxrl_llm.models.packing import PackedLayout, batch_layout
    from jaxrl_llm.models.sequences import Sequences
    from jaxrl_llm.optim import make_optimizer
    from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss
    from jaxrl_llm.trainers.step import train_step

    new = context - PROMPT + 1  # inputs: prompt + completion[:-1] = context positions
    valid = np.ones((1, context), np.int32)
    layout = batch_layout(valid, PROMPT)[0]
    optimizer = make_optimizer(OptimSection(learning_rate=1e-6), 100)[0]
    placed = None
    if sequence > 1:
        from jaxrl_llm.sharding import MeshShape, make_mesh, sequence_mesh

        mesh = make_mesh(MeshShape(1, 1, 1, sequence=sequence), jax.devices()[:sequence])
        config = config.replace(sequence_mesh=sequence_mesh(mesh))
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(x: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed)

    shapes = jax.tree.map(put, param_shapes(config))

    def ints(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=placed)

    def floats(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=placed)

    batch = PolicyBatch(Sequences(ints(1, PROMPT), ints(1, PROMPT), ints(1, new), ints(1, new)), floats(1, new),
                        floats(1, new),
                        floats(1), layout=PackedLayout(ints(*layout.source.shape), ints(*layout.predictor.shape)))
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config,
                             loss_config=PolicyObjective(beta=0.04, max_len=new, logprob_block_mib=256.0),
                             optimizer=optimizer, grad_accum=1)  # the log-prob block of a run's default
    jitted = jax.jit(step, donate_argnums=(0, 1))
    return jitted, (shapes, jax.tree.map(put, jax.eval_shape(optimizer.init, shapes)), batch), layout


def concrete(config: Any, args: tuple[Any, ...], layout: Any) -> tuple[Any, ...]:
    """Random arguments of the shapes `args` (the layout's real values: one sequence in one row)."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.packing import PackedLayout
    from jaxrl_llm.models.weights import master_weights

    params = master_weights(init_params(config, jax.random.key(0)))
    shapes, _, batch = args
    rng = np.random.default_rng(0)
    def fill(name: str, spec: Any) -> Any:
        if spec is None:
            return None
        if "mask" in name:
            return jnp.ones(spec.shape, spec.dtype)
        if spec.dtype == jnp.int32:
            return jnp.asarray(rng.integers(3, config.vocab_size, spec.shape), jnp.int32)
        return jnp.asarray(-rng.uniform(0.5, 3.0, spec.shape), jnp.float32)

    fields = []
    for name, spec in batch._asdict().items():
        if name == "layout":
            fields.append(PackedLayout(jnp.asarray(layout.source), jnp.asarray(layout.predictor)))
        elif name == "sequences":
            fields.append(type(spec)(*(fill(n, s) for n, s in spec._asdict().items())))
        else:
            fields.append(fill(name, spec))
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.optim import make_optimizer

    optimizer = make_optimizer(OptimSection(learning_rate=1e-6), 100)[0]
    return params, optimizer.init(params), type(batch)(*fields)


def measure(config: Any, context: int, path: str, time_it: bool, sequence: int = 1) -> dict[str, Any]:
    """One row of the table: `path` (`dense` or `seam`) at `context` tokens, on `sequence` devices."""
    import jaxrl_llm.models.block as block
    from jaxrl_llm.models.attention import attention

    block.attention = dense_attention if path == "dense" else attention
    try:
        jitted, args, layout = update_program(config, context, sequence)
        start = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        compile_s = time.perf_counter() - start
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        if sequence > 1:
            path = f"{path}, sequence={sequence}"
        row = {"path": path, "context": context, "compiled_gib": total / GIB, "temp_gib": m.temp_size_in_bytes / GIB,
               "compile_s": compile_s}
        if time_it and sequence == 1:
            params, opt_state, batch = concrete(config, args, layout)
            params, opt_state, metrics = compiled(params, opt_state, batch)
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            params, opt_state, metrics = compiled(params, opt_state, batch)
            jax.block_until_ready(metrics)
            row["ms_per_token"] = (time.perf_counter() - start) / context * 1e3
        return row
    finally:
        block.attention = attention


def main() -> None:
    args = ARGS
    from jaxrl_llm.cli import plan
    from jaxrl_llm.models.hf import config_from_hf

    hf = plan.load_hf_config_dict(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    config = config_from_hf({**hf, "max_position_embeddings": max(contexts + [hf.get("max_position_embeddings", 0)])},
                            dtype=args.dtype, remat=not args.no_remat, attention_query_chunk=args.query_chunk)
    print(f"{cpu_model()}; {config.num_params() / 1e6:.1f}M params ({args.model}), {args.dtype}, "
          f"remat {'off' if args.no_remat else 'on'}, query chunk {args.query_chunk}; jax {jax.__version__}, "
          f"{jax.device_count()} device(s)", flush=True)
    rows = []
    runs = [(path, 1) for path in args.paths.split(",")]
    runs += [("seam", n) for n in (int(x) for x in args.sequence.split(",")) if n > 1]
    for context in contexts:
        for path, sequence in runs:
            row = measure(config, context, path, context <= args.time_up_to, sequence)
            rows.append(row)
            timing = f", {row['ms_per_token']:.2f} ms/token" if "ms_per_token" in row else ""
            print(f"  context {context:6d} {row['path']:17s}: compiled {row['compiled_gib']:.2f} GiB per device "
                  f"(temporaries {row['temp_gib']:.2f}){timing}; compiled in {row['compile_s']:.0f} s", flush=True)
    names = list(dict.fromkeys(r["path"] for r in rows))
    print("\n| context | " + " | ".join(f"{p}: GiB per device" for p in names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for context in contexts:
        cells = [f"{r['compiled_gib']:.2f}" + (f" ({r['ms_per_token']:.2f} ms/token)" if "ms_per_token" in r else "")
                 for r in rows if r["context"] == context]
        print(f"| {context} | " + " | ".join(cells) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
