"""GRPO in one file: the whole loop of the default job on one screen, written against the library's pure functions.

    for step in 1..steps:
        prompts  = the next P training problems                             (a shuffled pass over the data)
        y        ~ pi_old(. | prompt), G samples each                       jaxrl_llm.sampling.sample (jitted)
        r        = 1 if y's answer is right else 0                          math_answer_reward (host)
        A        = (r - mean_group(r)) / (std_group(r) + eps)               rl.group_normalized_advantages
        rho_t    = pi(y_t | x, y_<t) / pi_old(y_t | x, y_<t)                grpo_loss, below
        loss     = token-mean of -min(rho A, clip(rho, 1 - e, 1 + e) A)     grpo_loss (= rl.clipped_policy_loss,
                   + beta * k3(pi, pi_ref)                                  a test checks; beta = 0 by default)
        params  <- AdamW(clip_by_global_norm(grad loss))                    optax, warmup then constant lr

The loss is written out here; everything it imports is the model, the sampler, the data readers and the RL layer's
advantages and log-probs. No config system, no trainer, no shell: `python examples/nano_grpo.py` trains
`models/arith-base` on `data/arithmetic` with the default job's settings (`configs/grpo_arithmetic.yaml`: 150
steps of 16 prompts x 8 samples, lr 1e-4 with 5 warmup steps, bf16 matmuls) and prints the held-out greedy
accuracy before and after. `python train.py --algo grpo` adds what a run needs around this loop:
checkpoints, resume, evaluation cadence, logging, health checks, sharding, LoRA, the other algorithms.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm.data import bucket, read_jsonl
from jaxrl_llm.models.decoder import completion_hidden, unembed
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.rl import group_normalized_advantages, token_logprobs
from jaxrl_llm.sampling import SampleOutput, SamplingConfig, sample
from jaxrl_llm.sampling.padding import left_pad

ROOT = Path(__file__).resolve().parents[1]


class Batch(NamedTuple):
    """One rollout: prompts `[N, P]` (left-padded), completions `[N, T]` (right-padded, mask through EOS), the
    sampler's log-probs `[N, T]` (the old policy's), and one advantage per row `[N]`."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    tokens: jax.Array
    mask: jax.Array
    old_logp: jax.Array
    advantages: jax.Array


def prompt_batch(tokenizer: Any, problems: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and mask `[B, P]` of the problems' prompts, padded on the left (the sampler continues at P) to a
    multiple of 16, so every step's batch has the same shape and the train step compiles once."""
    ids = tokenizer([p["prompt"] for p in problems])["input_ids"]
    return left_pad(ids, bucket(max(map(len, ids))), tokenizer.pad_token_id)


def completions_text(tokenizer: Any, out: SampleOutput) -> list[str]:
    """The completions as text: each row's tokens under its mask (through EOS), special tokens dropped."""
    rows = [t[m.astype(bool)].tolist() for t, m in zip(np.asarray(out.tokens), np.asarray(out.mask), strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def exact_answer(completions: list[str], answers: list[str]) -> np.ndarray:
    """1.0 where the completion's last number is the answer, else 0.0 (the default job's reward on its data)."""
    last = [re.findall(r"-?\d+", c)[-1:] for c in completions]
    return np.asarray([float(n == [str(a)]) for n, a in zip(last, answers, strict=True)], np.float32)


def completion_logp(params: Any, config: Any, batch: Batch, temperature: float) -> jax.Array:
    """log pi(y_t | x, y_<t) `[N, T]`: one forward over prompt + completion[:-1], the state at P - 1 + t
    predicting y_t, its logits at `temperature`."""
    sequences = Sequences(batch.prompt_tokens, batch.prompt_mask, batch.tokens, batch.mask)
    hidden = completion_hidden(params, config, sequences).hidden
    return token_logprobs(unembed(params, config, hidden), batch.tokens, temperature=temperature)


def grpo_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *, epsilon: float,
              beta: float = 0.0, ref_logp: jax.Array | None = None) -> jax.Array:
    """GRPO's loss on `[N, T]` log-probs, one advantage per row `[N]`, the completion mask `[N, T]`:

        rho_t = exp(logp_t - old_logp_t)
        s_t   = min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon) A)      the clipped surrogate (PPO's)
        k3_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                 Schulman's k3 estimate of KL(pi || ref)
        loss  = sum_t mask_t (-s_t + beta k3_t) / sum_t mask_t             the token-mean over the whole batch
    """
    a = advantages[:, None]
    ratio = jnp.exp(jnp.where(mask > 0, logp - old_logp, 0.0))
    surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a)
    per_token = -surrogate
    if beta and ref_logp is not None:
        log_ref_ratio = jnp.where(mask > 0, ref_logp - logp, 0.0)
        per_token = per_token + beta * (jnp.exp(log_ref_ratio) - log_ref_ratio - 1)
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "epsilon", "beta", "temperature"))
def train_step(params: Any, opt_state: Any, ref_params: Any, batch: Batch, *, config: Any,
               optimizer: optax.GradientTransformation, epsilon: float, beta: float,
               temperature: float) -> tuple[Any, Any, dict[str, jax.Array]]:
    """One AdamW update on the whole rollout (the default job's mu = 1, one minibatch)."""
    ref_logp = jax.lax.stop_gradient(completion_logp(ref_params, config, batch, temperature)) if beta else None

    def loss_fn(p: Any) -> jax.Array:
        logp = completion_logp(p, config, batch, temperature)
        return grpo_loss(logp, batch.old_logp, batch.advantages, batch.mask, epsilon=epsilon, beta=beta,
                         ref_logp=ref_logp)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def accuracy(params: Any, config: Any, tokenizer: Any, problems: list[dict[str, Any]], max_new_tokens: int,
             batch_size: int = 500) -> float:
    """Share of `problems` whose greedy completion's answer is right."""
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, greedy=True, eos_ids=(tokenizer.eos_token_id,),
                            pad_id=tokenizer.pad_token_id, prompt_bucket=16, new_tokens_bucket=16)
    right = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        tokens, mask = prompt_batch(tokenizer, chunk)
        out = jax.device_get(sample(params, config, tokens, mask, jax.random.key(0), greedy))
        right += float(exact_answer(completions_text(tokenizer, out), [p["answer"] for p in chunk]).sum())
    return right / len(problems)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "arith-base")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "arithmetic", help="train.jsonl, test.jsonl")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=16, help="P: prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--epsilon", type=float, default=0.2, help="the ratio's clip range")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient to the starting policy")
    parser.add_argument("--dtype", default="bfloat16", help="matmul operands: bfloat16 | float32")
    parser.add_argument("--eval-size", type=int, default=1000, help="held-out problems (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config, params = load_hf_model(args.model, dtype=args.dtype)  # float32 weights, bf16 matmuls
    tokenizer = load_tokenizer(args.model)
    train, test = read_jsonl(args.data / "train.jsonl"), read_jsonl(args.data / "test.jsonl")
    test = test[:args.eval_size] if args.eval_size else test
    ref_params = params  # the starting policy (JAX arrays are immutable: updates make new ones)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup),
                                     optax.constant_schedule(args.lr)], [args.warmup])
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.0))
    opt_state = optimizer.init(params)
    rollout = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.group,
                             eos_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id, prompt_bucket=16,
                             new_tokens_bucket=16)
    before = accuracy(params, config, tokenizer, test, args.max_new_tokens)
    print(f"held-out greedy accuracy before: {before:.1%} ({len(test)} problems)")

    rng, key = np.random.default_rng(args.seed), jax.random.key(args.seed)
    order, cursor, start = rng.permutation(len(train)), 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        if cursor + args.prompts > len(order):  # a new pass over the data, reshuffled
            order, cursor = rng.permutation(len(train)), 0
        problems = [train[i] for i in order[cursor:cursor + args.prompts]]
        cursor += args.prompts
        prompt_tokens, prompt_mask = prompt_batch(tokenizer, problems)
        out = jax.device_get(sample(params, config, prompt_tokens, prompt_mask, jax.random.fold_in(key, step),
                                    rollout))
        answers = [p["answer"] for p in problems for _ in range(args.group)]
        rewards = exact_answer(completions_text(tokenizer, out), answers)
        advantages = group_normalized_advantages(jnp.asarray(rewards), group_size=args.group)
        batch = Batch(np.repeat(prompt_tokens, args.group, 0), np.repeat(prompt_mask, args.group, 0),
                      out.tokens, out.mask, out.logprobs_untruncated, advantages)
        params, opt_state, metrics = train_step(params, opt_state, ref_params, batch, config=config,
                                                optimizer=optimizer, epsilon=args.epsilon, beta=args.beta,
                                                temperature=1.0)
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  reward {rewards.mean():.3f}  loss {float(metrics['loss']):+.4f}  "
                  f"grad_norm {float(metrics['grad_norm']):.3f}  {time.perf_counter() - start:.1f} s")

    after = accuracy(params, config, tokenizer, test, args.max_new_tokens)
    print(f"held-out greedy accuracy after {args.steps} steps: {after:.1%} (before: {before:.1%})")
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()
