"""`python -m jaxrl_llm plan`: will this model, mesh and batch fit, before anything is allocated or compiled?

    python -m jaxrl_llm plan --model Qwen/Qwen2.5-0.5B --mesh data=1,fsdp=8,tensor=1 --batch 8 --group-size 8 \\
        --prompt-len 256 --new-tokens 512 --dtype bfloat16 --remat --device-memory 80GiB
    python -m jaxrl_llm plan --config configs/grpo_gsm8k_qwen2.5-0.5b.yaml --devices 8

Only `config.json` is read (a local model directory, a path to the file itself, or a hub id, for which only that
file is downloaded). What is counted and how: `jaxrl_llm.memory_plan` (the library this command prints).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxrl_llm import sharding
from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.config import load_run_config
from jaxrl_llm.engine import cpu_kernel
from jaxrl_llm.engine.pages import default_page_size
from jaxrl_llm.errors import UsageError
from jaxrl_llm.memory_plan import (
    DEFAULT_MODEL,
    TRAINER_BUCKET,
    MemoryPlan,
    axis_sizes_of,
    longest_context,
    mesh_tuple,
    plan_memory,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hf import ConversionError, config_from_hf, read_hf_config
from jaxrl_llm.preflight import check_model_source
from jaxrl_llm.sharding import MeshShape
from jaxrl_llm.trainers import algorithm_class

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """`"80GiB"` -> 85899345920, `"80GB"` / `"80G"` -> 8e10 (decimal), `"1.5TiB"`, `"123"` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB, 16GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """Binary units: `format_bytes(3 * 2**30) == "3.00 GiB"`."""
    sign, n_abs = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n_abs >= size:
            return f"{sign}{n_abs / size:.2f} {unit}"
    return f"{sign}{n_abs} B"


def parse_mesh(text: str) -> tuple[int, int, int, int]:
    """`"data=2,fsdp=2,expert=2,tensor=1"` (omitted axes are 1), `"2,2,2"` (data, fsdp, tensor) or `"2,2,2,1"`
    (data, fsdp, expert, tensor) -> `(data, fsdp, expert, tensor)` (a `sequence=N` entry: `parse_mesh_axes`)."""
    return parse_mesh_axes(text)[0]


def parse_mesh_axes(text: str) -> tuple[tuple[int, int, int, int], int]:
    """`(parse_mesh's (data, fsdp, expert, tensor), sequence)`: `parse_mesh`'s forms, and `sequence=N` among named
    axes (context parallelism; 1 when omitted)."""
    sizes = dict.fromkeys((*sharding.MESH_AXES, "sequence"), 1)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if all("=" not in p for p in parts):
            values = [int(p) for p in parts]
            if len(values) not in (3, 4):
                raise ValueError
            sizes |= axis_sizes_of(values)
        else:
            for part in parts:
                name, value = (x.strip() for x in part.split("="))
                if name not in sizes:
                    raise ValueError
                sizes[name] = int(value)
        if sizes["sequence"] < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"cannot read mesh {text!r}; write e.g. data=2,fsdp=2,tensor=2 (axes: data, fsdp, "
                         "expert, sequence, tensor; omitted ones are 1), 2,2,2 (data, fsdp, tensor) or 2,2,1,2"
                         ) from None
    return mesh_tuple(axis_sizes_of([sizes[a] for a in sharding.MESH_AXES])), sizes["sequence"]


def load_hf_config_dict(model: str) -> dict[str, Any]:
    """config.json of a model directory, of a path to that file, or of a hub id (downloads config.json only)."""

    path = Path(model).expanduser()
    if model == DEFAULT_MODEL and not path.exists():  # the committed model, from any working directory
        path = Path(__file__).resolve().parents[2] / DEFAULT_MODEL
    if path.is_dir():
        return read_hf_config(path)
    if path.is_file():
        return json.loads(path.read_text())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ConversionError(f"model directory {path} does not exist (nor is it a hub id)")

    check_model_source("--model", model)  # offline or unknown: one line at once, not the download's retries
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(model, "config.json")).read_text())
    except Exception as e:  # offline, unknown repo, gated model: say which file of which id failed
        raise ConversionError(f"could not fetch config.json of hub id {model!r}: {e}") from e


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m jaxrl_llm plan",
        description="Per-device memory of an RL step (params, reference, optimizer, gradients, KV cache, "
        "activations) from config.json alone, and whether it fits. `--config FILE [overrides]` plans the run "
        "that training config describes (its model, mesh, batch sizes, lengths, dtypes, remat, reference); "
        "the options below override it.",
    )
    p.add_argument("--config", type=Path, help="a training YAML (as train.py --config), with dotted overrides")
    p.add_argument("overrides", nargs="*", help="dotted overrides of --config, e.g. rl.group_size=16")
    p.add_argument("--model", help="HF model directory, config.json or hub id (or the --config run's model.path)")
    p.add_argument("--mesh", help="e.g. data=2,fsdp=2,tensor=2 or data=2,expert=4 (default: 1,1,1, or the "
                   "config's mesh)")
    p.add_argument("--devices", type=int, help="devices, for a config mesh with a -1 axis (default: what JAX sees)")
    p.add_argument("--prompts-per-step", "--batch", dest="prompts_per_step", type=int,
                   help="rl.prompts_per_step: prompts per step (default 16)")
    p.add_argument("--group-size", type=int, help="rl.group_size: samples per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, help="data.max_prompt_tokens: prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, help="sampling.max_new_tokens (default 64)")
    p.add_argument("--minibatch", type=int, help="rl.minibatch_size: sequences per update (0: all; default 0)")
    p.add_argument("--grad-accum", type=int, help="rl.grad_accum: micro-batches per update (default 1)")
    p.add_argument("--packing", action="store_true", default=None,
                   help="rl.packing: the update on packed rows (planned as padded: an upper bound)")
    p.add_argument("--bucket", type=int,
                   help="round prompt and completion lengths up to a multiple (default: the sampler's 16)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), help="model.dtype: compute dtype")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), help="model.param_dtype")
    p.add_argument("--remat", action="store_true", default=None, help="model.remat: rematerialise each layer")
    p.add_argument("--attention-query-chunk", type=int,
                   help="model.attention_query_chunk: queries per attention block (0: all at once; default 128)")
    p.add_argument("--reference", action="store_true", default=None,
                   help="a frozen reference copy (rl.beta > 0; from a config: beta > 0, or PPO's KL)")
    p.add_argument("--lora-rank", type=int, help="lora.rank: LoRA adapters of this rank over a frozen base (0: off)")
    p.add_argument("--lora-targets", help="lora.targets: regex of the adapted kernels' module names")
    p.add_argument("--logprob-block-mib", type=float,
                   help="model.logprob_block_mib: MiB of one float32 log-prob block (0: one block; default 256)")
    p.add_argument("--engine-page-size", type=int,
                   help="sampling.engine_page_size: the rollout engine's page size (default the platform's: 64 on "
                   "the CPU, 16 on GPU and TPU; 0: plan the static "
                   "sampler's cache instead; from a config: its page size, 0 when sampling.engine=static)")
    p.add_argument("--engine-pages", type=int, help="sampling.engine_pages: the engine's pool (0: what a step needs)")
    p.add_argument("--engine-attention", choices=("auto", "xla", "cpu", "pallas"),
                   help="sampling.engine_attention: xla (or engines of several tensor devices, or a sliding-window "
                   "model off the CPU kernel) adds the decode call's contiguous slot caches; a kernel reads the pages")
    p.add_argument("--max-tokens-per-microbatch", type=int,
                   help="rl.max_tokens_per_microbatch: plan a packed micro-batch of this many tokens")
    p.add_argument("--teacher", help="distill.teacher: count a distillation teacher's frozen weights (a model "
                   "directory or hub id)")
    p.add_argument("--jsd", action="store_const", const=True,
                   help="distill.loss=jsd: the teacher runs inside the update (its hidden states counted there)")
    p.add_argument("--max-staleness", type=int,
                   help="rollout.max_staleness: K > 0 samples beside the update (K + 1 weight copies; docs/overlap.md)")
    p.add_argument("--sampler-devices", type=int,
                   help="rollout.sampler_devices: the sampler's own devices (--mesh is then the trainer's)")
    p.add_argument("--sampler-tensor", type=int, help="rollout.sampler_tensor: the sampler mesh's tensor degree")
    p.add_argument("--device-memory", default="80GiB", help="usable memory per device, e.g. 80GiB, 24GB")
    p.add_argument("--longest-context", action="store_true",
                   help="also print the longest context (prompt + completion) whose step fits --device-memory, the "
                   "prompt length and every other setting as planned")
    return p


# (argparse dest, default without a config, the same setting in a RunConfig)
_SETTINGS: tuple[tuple[str, Any, Any], ...] = (
    ("model", "", lambda c: c.model.path),
    ("prompts_per_step", 16, lambda c: c.rl.prompts_per_step),
    ("group_size", 8, lambda c: c.rl.group_size),
    ("prompt_len", 64, lambda c: c.data.max_prompt_tokens),
    ("new_tokens", 64, lambda c: c.sampling.max_new_tokens),
    ("minibatch", 0, lambda c: c.rl.minibatch_size),
    ("grad_accum", 1, lambda c: c.rl.grad_accum),
    ("packing", False, lambda c: c.rl.packing),
    ("max_tokens_per_microbatch", 0, lambda c: c.rl.max_tokens_per_microbatch),
    ("bucket", TRAINER_BUCKET, lambda c: None),  # from a config: its own two buckets (below)
    ("dtype", "float32", lambda c: c.model.dtype),
    ("param_dtype", "float32", lambda c: c.model.param_dtype),
    ("remat", False, lambda c: c.model.remat),
    ("attention_query_chunk", 128, lambda c: c.model.attention_query_chunk),
    ("reference", False, lambda c: algorithm_class(c.algo).keeps_reference(c)),
    ("logprob_block_mib", 256.0, lambda c: c.model.logprob_block_mib),
    ("lora_rank", 0, lambda c: c.lora.rank),
    ("engine_page_size", default_page_size(),
     lambda c: (c.sampling.engine_page_size or default_page_size()) if c.sampling.engine == "paged" else 0),
    ("engine_pages", 0, lambda c: c.sampling.engine_pages),
    ("engine_attention", "auto", lambda c: c.sampling.engine_attention),
    ("lora_targets", "(q|k|v|o|gate|up|down)_proj", lambda c: c.lora.targets),
    ("teacher", "", lambda c: algorithm_class(c.algo).teacher(c)[0]),
    ("jsd", False, lambda c: algorithm_class(c.algo).teacher(c)[1]),
    ("max_staleness", 0, lambda c: c.rollout.max_staleness),
    ("sampler_devices", 0, lambda c: c.rollout.sampler_devices),
    ("sampler_tensor", 1, lambda c: c.rollout.sampler_tensor),
)


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The planned run's settings: command-line options over the `--config` run's, over the defaults."""

    config = load_run_config(args.config, args.overrides) if args.config else None
    if args.overrides and config is None:
        raise UsageError(f"overrides {args.overrides} need --config FILE (options such as --group-size work alone)")
    out: dict[str, Any] = {}
    for name, default, from_config in _SETTINGS:
        given = getattr(args, name)
        out[name] = given if given is not None else from_config(config) if config is not None else default
    if out["bucket"] is None:
        sampling = config.sampling  # type: ignore[union-attr]
        out["prompt_bucket"], out["new_tokens_bucket"] = sampling.prompt_bucket, sampling.new_tokens_bucket
    else:
        out["prompt_bucket"] = out["new_tokens_bucket"] = out["bucket"]
    if args.mesh:
        out["mesh"], out["sequence"] = parse_mesh_axes(args.mesh)
    elif config is not None:
        devices = (args.devices or jax.device_count()) - out["sampler_devices"]
        out["sequence"] = config.mesh.sequence
        out["mesh"] = MeshShape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, expert=config.mesh.expert,
                                sequence=config.mesh.sequence).resolve(devices)
    else:
        out["mesh"], out["sequence"] = (1, 1, 1, 1), 1
    n, t = out["sampler_devices"], out["sampler_tensor"]
    if n and n % t:
        raise UsageError(f"rollout.sampler_tensor={t} must divide rollout.sampler_devices={n}")
    out["sampler_mesh"] = (n // t, 1, 1, t) if n else None
    if not out["model"]:
        raise UsageError("no model to plan: give --model DIR_OR_HUB_ID, or --config FILE of a run")
    return out


def slot_caches_planned(config: ModelConfig, run: dict[str, Any]) -> bool:
    """Whether the engine's decode runs on the XLA path, which gathers contiguous slot caches (docs/engine.md):
    `sampling.engine_attention=xla`, data-parallel shards of several `tensor` devices each, or a sliding-window
    model where the attention is not the CPU kernel (the Pallas kernels have no window)."""
    tensor = (run["sampler_mesh"] or run["mesh"])[-1]
    sliding = any(config.is_sliding(i) for i in range(config.num_layers))
    return run["engine_attention"] == "xla" or tensor > 1 or (sliding and run["engine_attention"] != "cpu")


def packed_weights_planned(config: ModelConfig, run: dict[str, Any]) -> bool:
    """Whether the engine packs its decode weights for the AMX matmul (docs/engine.md): planned on a CPU whose
    kernel runs here (`amx_bf16`), for a bfloat16 model on shards of one device with the CPU attention kernel."""
    tensor = (run["sampler_mesh"] or run["mesh"])[-1]
    return (run["engine_attention"] in ("auto", "cpu") and tensor == 1 and config.dtype == "bfloat16"
            and jax.default_backend() == "cpu" and cpu_kernel._has_amx())


def _overlap_rows(plan: MemoryPlan, row: Any) -> list[str]:
    """The total's rows: synchronous, sampling beside the update on one mesh, or on a sampler mesh of its own."""
    k = plan.max_staleness
    if plan.sampler_mesh_sizes is not None:
        d, _, _, t = plan.sampler_mesh_sizes
        return [row("total, trainer (persistent + update)", plan.total),
                f"  sampler mesh data={d} tensor={t} ({d * t} devices, rollout.sampler_devices), per device:",
                row(f"  inference weight copies (K+1 = {k + 1})", plan.weight_copies),
                row("  KV cache (sampler)", plan.sampler_kv_cache),
                row("  sampler weight copy", plan.sampler_step_weights),
                row("total, sampler", plan.sampler_total)]
    if k:
        return [row(f"inference weight copies (K+1 = {k + 1})", plan.weight_copies,
                    "rollout.max_staleness: the sampler's, beside the update"),
                row("total (persistent + copies + both phases)", plan.total)]
    return [row("total (persistent + max of phases)", plan.total)]


def render(plan: MemoryPlan, config: ModelConfig, device_memory: int, *, model: str = "",
           ) -> str:
    """The CLI's table for `plan`."""
    c = config
    d, f, e, t = plan.mesh_sizes
    n = plan.sequence

    def row(label: str, n: int | None, note: str = "") -> str:
        value = "-" if n is None else format_bytes(n)
        return f"  {label:<36}{value:>12}  {note}".rstrip()

    act_note = (f"order-of-magnitude estimate; no remat {format_bytes(plan.activations_no_remat)}, "
                f"remat {format_bytes(plan.activations_remat)}")
    placed = (f"{c.num_experts // e} on each device (expert={e})" if e > 1 and c.num_experts % e == 0 else
              f"all {c.num_experts} on every device")
    experts = (f"; {c.num_experts} experts of I={c.moe_intermediate_size}, top-{c.num_experts_per_tok}, {placed}"
               + (f", shared I={c.shared_expert_intermediate_size}" if c.shared_expert_intermediate_size else "")
               if c.is_moe else "")
    lines = [
        f"model {model or '?'}: {c.model_type}, {plan.num_params / 1e6:,.2f}M params "
        f"(L={c.num_layers} D={c.hidden_size} H={c.num_heads} KVH={c.num_kv_heads} hd={c.head_dim} "
        f"I={c.intermediate_size} V={c.vocab_size}{' tied' if c.tie_word_embeddings else ''}{experts})",
        f"mesh data={d} fsdp={f}" + (f" expert={e}" if e > 1 or c.is_moe else "")
        + (f" sequence={n}" if n > 1 else "") + f" tensor={t} "
        f"({d * f * e * n * t} devices); params {c.param_dtype}, "
        f"compute {c.dtype}, "
        f"AdamW, remat {'on' if c.remat else 'off'}",
        f"rollout: {plan.rollout_rows} sequences per device, KV cache length {plan.cache_length}; "
        f"update: {plan.micro_rows} sequences x {plan.train_seq_len} tokens per device per micro-batch"
        + (f", its positions split over {n} sequence devices" if n > 1 else ""),
        "",
        f"  {'per device':<36}{'bytes':>12}",
        row("params (policy)" if not plan.merged else "params (frozen base + LoRA adapters)", plan.params,
            f"{plan.trainable / 1e6:,.2f}M trainable" if plan.merged else ""),
        *([row("teacher params (distill)", plan.teacher)] if plan.teacher else []),
        *([row("teacher hidden states (jsd, update)", plan.teacher_hidden)] if plan.teacher_hidden else []),
        row("reference params", plan.reference if plan.reference else None,
            "(the frozen base: adapters off)" if plan.merged else "" if plan.reference else "(no --reference)"),
        row("optimizer state (AdamW)", plan.optimizer),
        row("gradients (float32 accumulator)", plan.gradients),
        row("KV cache (sampler)", plan.kv_cache),
        row("sampler weight copy", plan.sampler_weights),
        *([row("LoRA merged weights (rollout, update)", plan.merged)] if plan.merged else []),
        row(f"activations (train step{', remat' if plan.remat else ''})", plan.activations, act_note),
        "  " + "-" * 48,
        row("persistent: params+ref+teacher+opt" if plan.teacher else "persistent: params+ref+optimizer",
            plan.persistent),
        row("rollout: KV cache+sampler copy", plan.rollout),
        row("update: gradients+activations", plan.update),
        row("train step program alone", plan.train_step,
            "params+optimizer+batch+update: what XLA's memory_analysis() reports"),
        *_overlap_rows(plan, row),
        row("device memory", device_memory),
        "",
    ]
    margin = plan.margin(device_memory)
    if plan.fits(device_memory):
        lines.append(f"FITS: margin {format_bytes(margin)} ({100 * margin / device_memory:.1f}% of the device free)")
    else:
        lines.append(f"DOES NOT FIT: short by {format_bytes(-margin)} ({plan.total / device_memory:.2f}x the device)"
                     "; try a larger fsdp, --remat, --grad-accum, bfloat16, or a smaller batch")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrl_llm plan ...`: print the plan table; exit 0 whether or not it fits, 2 on bad input."""
    args = _parser().parse_intermixed_args(argv)

    try:
        run = resolve_settings(args)
        device_memory = parse_bytes(args.device_memory)
        config = config_from_hf(load_hf_config_dict(run["model"]), dtype=run["dtype"], param_dtype=run["param_dtype"],
                                remat=run["remat"], attention_query_chunk=run["attention_query_chunk"])
        settings = dict(
            batch=run["prompts_per_step"], group_size=run["group_size"], minibatch=run["minibatch"],
            grad_accum=run["grad_accum"], reference=run["reference"],
            prompt_bucket=run["prompt_bucket"], new_tokens_bucket=run["new_tokens_bucket"],
            logprob_block_mib=run["logprob_block_mib"], lora_rank=run["lora_rank"], lora_targets=run["lora_targets"],
            engine_page_size=run["engine_page_size"], engine_pages=run["engine_pages"],
            teacher=config_from_hf(load_hf_config_dict(run["teacher"]), param_dtype=run["param_dtype"])
            if run["teacher"] else None, teacher_in_update=run["jsd"],
            max_tokens_per_microbatch=run["max_tokens_per_microbatch"], max_staleness=run["max_staleness"],
            sampler_mesh_sizes=run["sampler_mesh"], engine_slot_caches=slot_caches_planned(config, run),
            engine_packed_weights=bool(run["engine_page_size"]) and packed_weights_planned(config, run),
            sequence=run["sequence"],
        )
        plan = plan_memory(config, run["mesh"], prompt_len=run["prompt_len"], new_tokens=run["new_tokens"],
                           **settings)
        longest = (longest_context(config, run["mesh"], device_memory, prompt_len=run["prompt_len"],
                                   multiple=run["new_tokens_bucket"], **settings) if args.longest_context else None)
    except (ValueError, OSError) as e:  # bad sizes, mesh or model: the user's input (ConversionError included)
        raise UsageError(str(e)) from e
    if args.config:
        print(f"planning {args.config}: rl.prompts_per_step={run['prompts_per_step']} x rl.group_size="
              f"{run['group_size']}, data.max_prompt_tokens={run['prompt_len']}, sampling.max_new_tokens="
              f"{run['new_tokens']}, rl.minibatch_size={run['minibatch']}, rl.grad_accum={run['grad_accum']}")
    if run["max_tokens_per_microbatch"]:
        print(f"rl.max_tokens_per_microbatch={run['max_tokens_per_microbatch']}: a micro-batch is planned as the "
              f"packed rows that many tokens fill (first-fit decreasing's bound), {plan.micro_rows} per device")
    elif run["packing"]:  # packed rows hold the micro-batch's sequences in at most as many rows of the same length
        print("rl.packing: the update's micro-batch is planned padded, an upper bound of its packed rows (the same "
              "sequences in at most as many rows of the same length; docs/packing.md)")
    print(render(plan, config, device_memory, model=run["model"]))
    if longest is not None:
        print(f"longest context that fits {format_bytes(device_memory)} per device: {longest:,} tokens "
              f"({run['prompt_len']} prompt + {max(longest - run['prompt_len'], 0):,} completion; every other setting "
              "as planned)" if longest else f"longest context: none fits {format_bytes(device_memory)} per device")
    return 0

