"""Sample completions from any supported Hugging Face checkpoint with the jitted sampler.

    python -m jaxrl_llm generate --model DIR_OR_HUB_ID --prompt "Once upon a time" [--prompt "..."] [--chat]
        [--max-new-tokens 128] [--greedy | --temperature 1.0] [--top-k 0] [--top-p 1.0] [--min-p 0.0]
        [--n 1] [--seed 0] [--dtype float32|bfloat16] [--cpu-devices N]

Prompts are tokenised with the checkpoint's tokenizer (`--chat` wraps each in the tokenizer's chat template
as one user message, with the generation prompt), left-padded into one batch and sampled in one call. The
padding id is the tokenizer's pad token, else its unk token, else its EOS token. Sampling stops at the EOS
ids of `generation_config.json` (an id or a list) when present, else at the tokenizer's EOS token.
Prints every completion, then tokens/s of generation with the compile time reported apart.

`--cpu-devices N` (CPU hosts) splits the host into N XLA CPU devices and the prompt batch over them
(`sample(..., mesh=)` on a `data=N` mesh): XLA runs the N programs on different cores, where one program
leaves cores idle in its small-batch token steps (1.3x on 2 cores, bench/HISTORY.md). The tokens are the same
as with one device.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxrl_llm.cli.errors import CommandParser
from jaxrl_llm.engine import make_sampler
from jaxrl_llm.errors import UsageError
from jaxrl_llm.models.hf import load_hf_model, resolve_model_dir
from jaxrl_llm.models.tokenizer import check_tokenizer_files
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.sampling.options import SAMPLERS
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import MeshShape, make_mesh, shard_params


def eos_ids_for(model_dir: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from `generation_config.json` (int or list), else the tokenizer's EOS token, else none."""
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)


def pad_id_for(tokenizer: Any) -> int:
    for token_id in (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, of the chat template applied to it as a user message."""
    if not chat:
        return [list(tokenizer(p)["input_ids"]) for p in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat: this tokenizer has no chat template (drop --chat to use the raw prompt)")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    # The template already holds the special tokens (BOS, role markers): do not add them twice.
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def completion_text(tokenizer: Any, prompt_ids: list[int], completion_ids: list[int]) -> str:
    """The completion decoded in the context of its prompt (so a SentencePiece leading space survives)."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full_text = tokenizer.decode(prompt_ids + completion_ids, skip_special_tokens=True)
    if full_text.startswith(prompt_text):
        return full_text[len(prompt_text) :]
    return tokenizer.decode(completion_ids, skip_special_tokens=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CommandParser(
        prog="python -m jaxrl_llm generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="local HF model directory or hub id")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0.0 = off")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter and compute dtype")
    parser.add_argument("--engine", choices=SAMPLERS, default="paged",
                        help="the paged rollout engine (docs/engine.md), or a static batch")
    parser.add_argument("--cpu-devices", type=int, default=1,
                        help="split the batch over N XLA CPU devices (static: the number of prompts must divide by N)")
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "n"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p < 1:
        parser.error("--temperature and --top-k must be >= 0, --top-p in (0, 1], --min-p in [0, 1)")
    if args.cpu_devices < 1 or len(args.prompt) % args.cpu_devices:
        parser.error(f"--cpu-devices {args.cpu_devices} must be >= 1 and divide the number of prompts "
                     f"({len(args.prompt)})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = None
    if args.cpu_devices > 1:
        # Must precede the first use of a device (raises otherwise).
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        mesh = make_mesh(MeshShape(data=args.cpu_devices, fsdp=1, tensor=1), jax.devices("cpu"))
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    check_tokenizer_files(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config, params = load_hf_model(model_dir, param_dtype=args.dtype, dtype=args.dtype)
    if mesh is not None:
        params = shard_params(params, mesh)
    greedy = args.greedy or args.temperature == 0
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=1.0 if greedy else args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        greedy=greedy,
        n=args.n,
        eos_ids=eos_ids_for(model_dir, tokenizer),
        pad_id=pad_id_for(tokenizer),
    )
    prompt_ids = encode_prompts(tokenizer, args.prompt, args.chat)
    tokens, mask = left_pad(prompt_ids, max(map(len, prompt_ids)), sampling.pad_id)
    key = jax.random.key(args.seed)

    start = time.perf_counter()
    sampler = make_sampler(args.engine, config)  # its programs compile on their first call: a warm-up call
    jax.block_until_ready(sampler(params, tokens, mask, key, sampling, mesh).tokens)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.device_get(sampler(params, tokens, mask, key, sampling, mesh))
    generate_s = time.perf_counter() - start

    for row in range(out.tokens.shape[0]):
        prompt, sample = divmod(row, sampling.n)
        length = int(out.lengths[row])
        stop = "EOS" if out.stopped_on_eos[row] else "length"
        print(f"--- prompt {prompt}, sample {sample}: {length} tokens, stopped on {stop} ---")
        print(completion_text(tokenizer, prompt_ids[prompt], out.tokens[row, :length].tolist()))
    made = int(out.lengths.sum())
    print(
        f"--- {made} tokens in {generate_s:.2f} s: {made / generate_s:.1f} tokens/s "
        f"(batch {out.tokens.shape[0]}, {args.engine}; compile and a warm-up call {compile_s:.2f} s, not included) ---"
    )
    return 0

