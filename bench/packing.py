"""One optimizer update of a GRPO-shaped batch, padded against packed (`rl.packing`), on the same sequences.

    python bench/packing.py [--model DIR] [--rows 16] [--max-new 128] [--grad-accum 1] [--repeats 2]
                            [--row-tokens 0] [--tiny]

The batch is what a GRPO step with EOS on trains on: prompts of 40-120 tokens (left-padded to the longest, rounded
to 16 as the sampler buckets them), completions whose lengths vary several-fold (half short answers of 8-40 tokens,
half long ones up to `--max-new`, a quarter of those cut at the limit), right-padded to the longest. The update is
`train_step` with the policy loss (token-mean, no KL), `--grad-accum` micro-batches, bf16 compute over float32
master weights, through `jit_one_step_update` (what SFT runs; the GRPO family's scan runs the same step). Prints the
share of computed positions that are padding in each layout, the best-of-`--repeats` seconds per update after a
compile call, real (non-pad) tokens per second, the speed-up, and the ideal one (padded positions over packed
positions): the issue's target is a packed time within 1.1x of that ideal.

The model: SmolLM2-135M-Instruct from `../shared/models/smollm2-135m-instruct/hf` by default; `--tiny`, a random
two-layer model for the smoke test.
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
from jaxrl_llm.config import OptimSection  # noqa: E402
from jaxrl_llm.models.decoder import init_params  # noqa: E402
from jaxrl_llm.models.hf import config_from_hf, load_hf_model  # noqa: E402
from jaxrl_llm.models.packing import batch_layout, update_layouts  # noqa: E402
from jaxrl_llm.models.sequences import Sequences  # noqa: E402
from jaxrl_llm.models.weights import master_weights  # noqa: E402
from jaxrl_llm.optim import make_optimizer  # noqa: E402
from jaxrl_llm.sharding import MeshShape, init_optimizer_state, make_mesh, param_shardings  # noqa: E402
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss  # noqa: E402
from jaxrl_llm.trainers.step import jit_one_step_update, state_sharding  # noqa: E402

SMOLLM2 = ROOT.parent / "shared" / "models" / "smollm2-135m-instruct" / "hf"
TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


def grpo_shaped_batch(rows: int, max_new: int, vocab: int, seed: int = 0) -> PolicyBatch:
    """Prompts of 40-120 tokens (width rounded to 16), completions half short (8-40) and half long (up to
    `max_new`, a quarter of them at the limit), right-padded to the longest."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(40, 121, rows)
    long = rng.integers(max_new // 2, max_new + 1, rows)
    long[rng.random(rows) < 0.25] = max_new
    clen = np.where(np.arange(rows) % 2 == 0, rng.integers(8, 41, rows), long)
    p = -(-plen.max() // 16) * 16
    t = int(clen.max())
    pm = (np.arange(p)[None] >= p - plen[:, None]).astype(np.int32)
    cm = (np.arange(t)[None] < clen[:, None]).astype(np.int32)
    pt = np.where(pm, rng.integers(3, vocab, (rows, p)), 0).astype(np.int32)
    ct = np.where(cm, rng.integers(3, vocab, (rows, t)), 0).astype(np.int32)
    old = (rng.normal(-3.0, 1.0, (rows, t)) * cm).astype(np.float32)
    adv = rng.normal(0.0, 1.0, rows).astype(np.float32)
    return PolicyBatch(Sequences(pt, pm, ct, cm), old, old, adv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(SMOLLM2))
    add_int_options(ap, {"--rows": 16, "--max-new": 128, "--grad-accum": 1, "--repeats": 2})
    ap.add_argument("--row-tokens", type=int, default=0, help="packed rows' length if over S (default S)")
    ap.add_argument("--tiny", action="store_true", help="a random two-layer model (the smoke test)")
    args = ap.parse_args()

    overrides = dict(dtype="bfloat16", param_dtype="float32", remat=True)
    if args.tiny:
        config = config_from_hf({**TINY, **overrides})
        params = init_params(config, jax.random.key(0))
        name = "random 2-layer model"
    else:
        config, params = load_hf_model(args.model, **overrides)
        name = Path(args.model).name if Path(args.model).name != "hf" else Path(args.model).parent.name
    mesh = make_mesh(MeshShape(1, 1, 1), jax.devices()[:1])
    params = jax.device_put(master_weights(params), param_shardings(params, mesh))
    optimizer, _ = make_optimizer(OptimSection(learning_rate=1e-6), 10)
    batch = grpo_shaped_batch(args.rows, args.max_new, config.vocab_size)
    seqs = batch.sequences
    valid = seqs.inputs()[1] > 0
    if args.grad_accum == 1:
        layout, frac_padded, frac_packed = batch_layout(valid, seqs.prompt_tokens.shape[1],
                                                        row_tokens=args.row_tokens)
    else:
        plan = update_layouts(valid, seqs.prompt_tokens.shape[1], np.arange(args.rows)[None], args.grad_accum,
                              row_tokens=args.row_tokens)
        layout = jax.tree.map(lambda x: x[0], plan.layouts)
        frac_padded, frac_packed = plan.padding_frac_padded, plan.padding_frac_packed
    real = int(valid.sum())
    print(f"{name}, bf16 compute over float32 master weights, {args.rows} sequences: prompts "
          f"{int(seqs.prompt_mask.sum(1).min())}-{int(seqs.prompt_mask.sum(1).max())} tokens (padded to "
          f"{seqs.prompt_tokens.shape[1]}), completions {int(seqs.completion_mask.sum(1).min())}-"
          f"{int(seqs.completion_mask.sum(1).max())}, {args.grad_accum} micro-batches; {real} real positions; packed "
          f"rows of {layout.source.shape[-1]} tokens ({layout.source.shape[0] // max(args.grad_accum, 1)} per "
          f"micro-batch, padded: {args.rows // args.grad_accum} of {valid.shape[1]})")
    state = {"params": params, "opt_state": init_optimizer_state(optimizer, params, param_shardings(params, mesh),
                                                                 mesh)}
    update = jit_one_step_update(mesh, state_sharding(state), loss_fn=policy_loss, model_config=config,
                                 loss_config=PolicyObjective(logprob_block_mib=64.0), optimizer=optimizer,
                                 grad_accum=args.grad_accum)
    seconds = {}
    for label, b, frac in (("padded", batch, frac_padded), ("packed", batch._replace(layout=layout), frac_packed)):
        b = jax.tree.map(jnp.asarray, b)
        holder = {"state": jax.tree.map(jnp.copy, state)}

        def call(b: PolicyBatch = b, holder: dict = holder) -> None:
            holder["state"], metrics = update(holder["state"], b, jax.random.key(0), None)
            jax.block_until_ready(metrics["loss"])

        call()  # compile
        seconds[label] = best_seconds(call, args.repeats)
        print(f"  {label}: padding {frac:.1%} of the computed positions, {seconds[label]:.2f} s per update, "
              f"{real / seconds[label]:,.0f} real tokens/s")
    ideal = (1.0 - frac_packed) / (1.0 - frac_padded)  # padded positions / packed positions
    speedup = seconds["padded"] / seconds["packed"]
    print(f"packed / padded: {speedup:.2f}x faster; ideal (padded positions / packed positions) {ideal:.2f}x; "
          f"packed time over the ideal: {ideal / speedup:.2f}x")


if __name__ == "__main__":
    main()
