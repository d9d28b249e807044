"""Where the GRPO update's time goes: op time by kind from a `jax.profiler` trace, beside the model-FLOP rate.

    python bench/update_profile.py --model DIR                 # bench/grpo_vs_trl.py's shape: 32 x (P + 32), bf16
    python bench/update_profile.py --model DIR --gsm8k         # one GSM8K-shaped micro-batch: 32 x (256 + 512)
    python bench/update_profile.py --model DIR --override model.remat=true --override rl.beta=0

The update is the GRPO trainer's own (`GRPOFamily.update`: the reference pass, the old policy's where asked for,
then the jitted train step: forward, backward, AdamW), run on a synthetic rollout of random tokens with every
completion token real (no EOS), after `--warmup` calls that compile it. One more call runs under
`jax.profiler.trace`; every XLA op the trace records (a thunk of XLA:CPU, a kernel on a GPU) is put in a kind by
the HLO it ran (read from `--xla_dump_to`): the matmuls of the weights, attention's matmuls and the rest of
attention (scores, mask, softmax), the LM head's matmul and its log-softmax and gather, the norms, the optimizer,
the layer loop's bookkeeping (slices and stacked residuals), casts, copies and transposes, other elementwise work.
The scopes come from `jax.named_scope`s in the model (`attention`, `norm`), the log-probs (`lm_head`) and the train
step (`optimizer`). What the trace does not cover of the call's wall time is host work and idle time.

Model FLOPs (`common.update_flops`: the reference forward and the policy's forward and backward, 4 x forward per
row, attention over the context each position sees, the LM head at completion positions) over the wall time,
against a jitted 1024^3 matmul in the compute dtype measured in the same run, is the update's rate.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DUMP = tempfile.mkdtemp(prefix="update_profile_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()

import numpy as np  # noqa: E402
from common import add_int_options, cpu_model, jax_matmul_flops, model_dims, update_flops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's jaxrl_llm, installed or not

SCOPES = ("optimizer", "lm_head", "attention", "norm")
KINDS = ("matmuls (weights)", "attention matmuls", "attention: scores, mask, softmax", "LM head matmul",
         "LM head: log-softmax, gather", "norms", "optimizer", "layer loop: slices, stacked residuals", "casts",
         "copies, transposes", "other elementwise")


# ------------------------------------------------------------------------------------------------ the HLO's kinds

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S+ (\w[\w\-]*)\(")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
OP_NAME = re.compile(r'op_name="([^"]*)"')
COMPUTATION = re.compile(r"^%?([\w.\-]+) .*\{\s*$")


def parse_hlo(text: str) -> tuple[dict[str, tuple[str, str, str | None]], dict[str, list[tuple[str, str]]]]:
    """`(instructions, computations)`: each instruction's `(opcode, op_name, called computation)`, and each
    computation's `(opcode, op_name)` list."""
    instructions: dict[str, tuple[str, str, str | None]] = {}
    computations: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    current = ""
    for line in text.splitlines():
        if not line.startswith(" ") and (m := COMPUTATION.match(line)):
            current = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        op_name = (OP_NAME.search(line) or [None, ""])[1]
        called = CALLS.search(line)
        instructions[name] = (opcode, op_name, called.group(1) if called else None)
        computations[current].append((opcode, op_name))
    return instructions, computations


def kind_of(name: str, instructions: dict, computations: dict) -> str:
    """The kind (`KINDS`) of the op `name` ran: by its opcodes (those of the computation it calls, for a fusion)
    and the named scope of its op_name."""
    opcode, op_name, called = instructions.get(name, ("", "", None))
    inner = computations.get(called, []) if called else []
    opcodes = {opcode} | {o for o, _ in inner}
    names = [op_name] + [n for _, n in inner]
    scope = next((s for s in SCOPES if any(re.search(rf"[/(]{s}[)/]", n) for n in names)), "")
    if opcodes & {"dot", "convolution"} or "gemm" in name or "cublas" in name:
        return {"attention": "attention matmuls", "lm_head": "LM head matmul"}.get(scope, "matmuls (weights)")
    if scope == "attention":
        return "attention: scores, mask, softmax"
    if scope == "lm_head":
        return "LM head: log-softmax, gather"
    if scope == "norm":
        return "norms"
    if scope == "optimizer":
        return "optimizer"
    if opcodes & {"dynamic-update-slice", "dynamic-slice", "while", "slice"}:
        return "layer loop: slices, stacked residuals"
    if opcodes <= {"convert", "bitcast", "parameter", "fusion"} and "convert" in opcodes:
        return "casts"
    if opcodes <= {"copy", "transpose", "bitcast", "parameter", "fusion", "broadcast"}:
        return "copies, transposes"
    return "other elementwise"


def load_hlo() -> dict[str, tuple[dict, dict]]:
    """Each dumped module's `parse_hlo`, by module name (`jit_update`, ...; a name compiled twice: both merged)."""
    modules: dict[str, tuple[dict, dict]] = {}
    for path in glob.glob(os.path.join(DUMP, "*after_optimizations.txt")):
        name = Path(path).name.split(".")[1]
        instructions, computations = modules.setdefault(name, ({}, {}))
        i, c = parse_hlo(Path(path).read_text())
        instructions |= i
        computations |= c
    return modules


def op_times(trace_dir: str) -> tuple[dict[str, float], float, dict[tuple[str, str], float]]:
    """`({kind: seconds}, busy seconds, {(op, kind): seconds})` from the trace's XLA ops (busy: the union of their
    intervals)."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    modules = load_hlo()
    totals: dict[str, float] = collections.defaultdict(float)
    per_op: dict[tuple[str, str], float] = collections.defaultdict(float)
    spans = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        seconds = float(e.get("dur", 0)) / 1e6
        module = args.get("hlo_module", "")
        kind = kind_of(args["hlo_op"], *modules.get(module, ({}, {})))
        totals[kind] += seconds
        per_op[f"{module}:{args['hlo_op']}", kind] += seconds
        spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    busy, end = 0.0, -1.0
    for a, b in sorted(spans):
        if b > end:
            busy += (b - max(a, end)) / 1e6
            end = b
    return dict(totals), busy, dict(per_op)


# ------------------------------------------------------------------------------------------------ the update


def synthetic_rollout(rows: int, group: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0) -> Any:
    from jaxrl_llm.sampling import SampleOutput
    from jaxrl_llm.trainers.rollouts import Rollout

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab, (rows, new_tokens)).astype(np.int32)
    logp = -rng.uniform(0.5, 3.0, (rows, new_tokens)).astype(np.float32)
    out = SampleOutput(tokens=tokens, mask=np.ones_like(tokens), logprobs=logp, logprobs_untruncated=logp,
                       lengths=np.full(rows, new_tokens, np.int32), stopped_on_eos=np.zeros(rows, bool))
    prompts = np.repeat(rng.integers(3, vocab, (rows // group, prompt_len)).astype(np.int32), group, axis=0)
    return Rollout(prompt_tokens=prompts, prompt_mask=np.ones_like(prompts), out=out,
                   rewards=rng.normal(size=rows).astype(np.float32), per_function={}, completions=[""] * rows,
                   record_indices=np.arange(rows // group))


def build_trainer(args: argparse.Namespace, out_dir: str, data: Path) -> Any:
    from jaxrl_llm.config import load_run_config
    from jaxrl_llm.trainers.grpo import GRPOFamily

    config = load_run_config(None, [
        f"model.path={args.model}", f"data.train={data}", "data.eval=''", f"out_dir={out_dir}",
        f"rl.prompts_per_step={args.rows // args.group}", f"rl.group_size={args.group}", "rl.beta=0.04", "rl.mu=1",
        f"sampling.max_new_tokens={args.new_tokens}", "optim.learning_rate=1e-6", "progress_bar=false",
        "tensorboard=false", "checkpoint_every=0", "export=false", f"model.dtype={args.dtype}",
        *(["model.remat=true", "model.attention_query_chunk=64", f"rl.minibatch_size={args.rows}"]
          if args.gsm8k else []),
        *args.override,
    ])
    return GRPOFamily(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="../shared/models/smollm2-135m-instruct/hf")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gsm8k", action="store_true", help="one GSM8K-shaped micro-batch: 32 x (256 + 512)")
    parser.add_argument("--override", action="append", default=[], help="KEY=VALUE of the run config")
    add_int_options(parser, {"--rows": 32, "--group": 8, "--prompt-len": 32, "--new-tokens": 32, "--warmup": 2,
                             "--top": 0})
    args = parser.parse_args()
    if args.gsm8k:
        args.rows, args.prompt_len, args.new_tokens = 32, 256, 512
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(64)))
        trainer = build_trainer(args, tmp, data)
        config = trainer.policy.model_config
        ro = synthetic_rollout(args.rows, args.group, args.prompt_len, args.new_tokens, config.vocab_size)
        state, key = trainer.init(), jax.random.key(0)
        for i in range(args.warmup):
            start = time.perf_counter()
            state = trainer.update(state, ro, i + 1, key).state
            jax.block_until_ready(state)
            print(f"warm-up update {i + 1}: {time.perf_counter() - start:.2f} s", flush=True)
        trace_dir = os.path.join(tmp, "trace")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            updated = trainer.update(state, ro, args.warmup + 1, key)
            jax.block_until_ready(updated.state)
            wall = time.perf_counter() - start
        totals, busy, per_op = op_times(trace_dir)
    report(args, config, wall, totals, busy, per_op)
    shutil.rmtree(DUMP, ignore_errors=True)


def report(args: argparse.Namespace, config: Any, wall: float, totals: dict[str, float], busy: float,
           per_op: dict[tuple[str, str], float]) -> None:
    """The table: the update's model-FLOP rate, op seconds by kind and by program, the longest ops."""
    import jax

    rate = jax_matmul_flops(args.dtype)
    flops = update_flops(model_dims(config), args.rows, args.prompt_len, args.new_tokens)
    print(f"\n{cpu_model()}, {jax.device_count()} x {jax.devices()[0].device_kind}; {config.num_params() / 1e6:.1f}M "
          f"params, {args.dtype}, {args.rows} rows x ({args.prompt_len} + {args.new_tokens}) tokens; "
          f"overrides {args.override or 'none'}")
    print(f"update {wall:.3f} s (traced), {flops / 1e12:.3f} TFLOP of model work: {flops / wall / 1e9:.0f} GFLOP/s = "
          f"{flops / wall / rate:.2f} of the jitted 1024^3 {args.dtype} matmul ({rate / 1e9:.0f} GFLOP/s)\n")
    print("| kind | op seconds | share of op time |\n| --- | ---: | ---: |")
    total = sum(totals.values())
    for kind in KINDS:
        if totals.get(kind):
            print(f"| {kind} | {totals[kind]:.3f} | {totals[kind] / total:.2f} |")
    print(f"| all ops (summed over threads) | {total:.3f} | 1.00 |")
    print(f"| wall not covered by any op (host, dispatch, idle) | {max(wall - busy, 0.0):.3f} | |")
    programs: dict[str, float] = collections.defaultdict(float)
    for (op, _), seconds in per_op.items():
        programs[op.split(":", 1)[0]] += seconds
    print("op seconds by program: " + ", ".join(f"{m} {t:.3f}" for m, t in sorted(programs.items(),
                                                                                 key=lambda kv: -kv[1])))
    if args.top:
        modules = load_hlo()
        print(f"\nthe {args.top} longest ops:")
        for (op, kind), seconds in sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]:
            module, name = op.split(":", 1)
            op_name = modules.get(module, ({}, {}))[0].get(name, ("", ""))[1]
            print(f"  {seconds:7.3f} s  {op:44s} {kind:32s} {op_name[-80:]}")


if __name__ == "__main__":
    main()
