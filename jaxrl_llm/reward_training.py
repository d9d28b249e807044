"""Reward-model training (`--algo rm`): Bradley-Terry on preference pairs, exported as a HF classifier.

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))          (Bradley & Terry 1952; Ouyang et al. 2022)

with `r` the score at the last token of `prompt + response` (`models/reward_model.sequence_scores`). The
model starts from a causal LM's decoder (`model.path`) with a fresh score head, or from a classifier's own
head. Data: JSONL with `prompt`, `chosen`, `rejected` (`data.chosen_field` / `data.rejected_field`);
`python -m jaxrl_llm.tasks.arithmetic` writes such pairs for the default task (the true answer over a
wrong one). The result is a `...ForSequenceClassification` directory that transformers loads and that the
`reward_model` reward function uses.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import ConfigError, RunConfig
from jaxrl_llm.data import DataError, DataState, bucket, left_pad, load_records, load_tokenizer, next_batch_indices
from jaxrl_llm.logging import RunLogger, write_summary
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.hf import is_classifier, load_hf_model, read_tensor, resolve_model_dir
from jaxrl_llm.models.reward_model import save_hf_reward_model, sequence_scores
from jaxrl_llm.rl.losses import dpo_loss
from jaxrl_llm.run_dir import open_run_dir
from jaxrl_llm.train_step import make_optimizer, master_weights, working_weights


class PreferenceBatch(NamedTuple):
    """Left-padded `prompt + response` token ids and masks `[B, T]` for both sides of each pair."""

    chosen_tokens: jax.Array
    chosen_mask: jax.Array
    rejected_tokens: jax.Array
    rejected_mask: jax.Array


def bradley_terry_loss(
    params: dict[str, Any], batch: PreferenceBatch, *, model_config: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`mean_i -log sigmoid(r_chosen_i - r_rejected_i)` and DPO-style metrics (accuracy, margins).

    This is `dpo_loss` with `beta = 1` and a zero reference: the "implicit rewards" are the scores themselves.
    """
    score = functools.partial(sequence_scores, params["decoder"], params["score"], model_config)
    chosen = score(batch.chosen_tokens, batch.chosen_mask)[:, 0]
    rejected = score(batch.rejected_tokens, batch.rejected_mask)[:, 0]
    zeros = jnp.zeros_like(chosen)
    return dpo_loss(chosen, rejected, zeros, zeros, beta=1.0, loss_type="sigmoid")


def encode_pairs(
    records: list[dict[str, Any]], label: str, tokenizer: Any, c: RunConfig
) -> list[tuple[list[int], ...]]:
    """`(chosen ids, rejected ids)` of `prompt + response` text (no special tokens, as `RewardModel` scores)."""
    d = c.data
    pairs = []
    for i, r in enumerate(records, start=1):
        missing = [f for f in (d.prompt_field, d.chosen_field, d.rejected_field) if f not in r]
        if missing:
            raise DataError(f"{label}:{i}: preference record lacks {missing} (fields: {sorted(r)})")
        pairs.append(tuple(tokenizer(str(r[d.prompt_field]) + str(r[side]), add_special_tokens=False)["input_ids"]
                           for side in (d.chosen_field, d.rejected_field)))
    return pairs


def make_batch(pairs: list[tuple[list[int], ...]], indices: np.ndarray, pad_id: int) -> PreferenceBatch:
    chosen = [pairs[i][0] for i in indices]
    rejected = [pairs[i][1] for i in indices]
    width = bucket(max(map(len, chosen + rejected)))
    return PreferenceBatch(*left_pad(chosen, width, pad_id), *left_pad(rejected, width, pad_id))


def initial_reward_model(c: RunConfig) -> tuple[ModelConfig, dict[str, Any], Path]:
    """Decoder from `model.path` (its lm head dropped) and a score head: the classifier's, or N(0, 0.02)."""
    model_dir = resolve_model_dir(c.model.path)
    config, decoder = load_hf_model(model_dir, tie_word_embeddings=True, dtype=c.model.dtype,
                                    param_dtype=c.model.param_dtype, remat=c.model.remat,
                                    attention_query_chunk=c.model.attention_query_chunk)
    if is_classifier(model_dir):
        score = jnp.asarray(read_tensor(model_dir, "score.weight").T)
    else:
        score = config.initializer_range * jax.random.normal(jax.random.key(c.seed), (config.hidden_size, 1))
    # Float32 master weights; the step computes with the working copy in param_dtype (train_step.master_weights).
    return config, master_weights({"decoder": decoder, "score": score}), model_dir


def pair_accuracy(params: Params, config: ModelConfig, pairs: list[tuple[list[int], ...]], pad_id: int,
                  batch_size: int) -> float:
    """Share of pairs whose chosen response scores strictly higher than the rejected one."""
    @jax.jit
    def margins(p: dict[str, Any], batch: PreferenceBatch) -> jax.Array:
        return bradley_terry_loss(p, batch, model_config=config)[1]["rewards/accuracies"]

    correct = 0.0
    for start in range(0, len(pairs), batch_size):
        idx = np.arange(start, min(start + batch_size, len(pairs)))
        correct += float(margins(params, make_batch(pairs, idx, pad_id))) * len(idx)
    return correct / len(pairs)


def train_reward_model(c: RunConfig, *, resume: bool = False, overwrite: bool = False,
                       allow_config_change: bool = False) -> dict[str, Any]:
    """Train a reward model in `c.out_dir` (claimed by `run_dir.open_run_dir`); `resume` continues from its
    latest checkpoint."""
    if jax.process_count() > 1:
        raise ConfigError("--algo rm runs in a single process (its step is not sharded); "
                          "unset distributed.enabled / JAX_COORDINATOR_ADDRESS")
    export_dir = Path(c.export_dir or Path(c.out_dir) / "hf")
    run_dir = open_run_dir(c, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                           export_dir=export_dir if c.export else None, input_dirs=(c.model.path,))
    try:
        return _train_reward_model(c, export_dir, resume)
    finally:
        run_dir.release()


def _train_reward_model(c: RunConfig, export_dir: Path, resume: bool) -> dict[str, Any]:
    out_dir = Path(c.out_dir)
    config, params, model_dir = initial_reward_model(c)
    tokenizer = load_tokenizer(model_dir)
    pad_id = int(tokenizer.pad_token_id)
    train = encode_pairs(*load_records(c.data.train, c.data.split), tokenizer, c)
    evals = encode_pairs(*load_records(c.data.eval, c.data.eval_split), tokenizer, c) if c.data.eval else None
    if c.eval_size and evals is not None:
        evals = evals[: c.eval_size]

    optimizer, schedule = make_optimizer(c.optim, max(c.steps, 1))
    opt_state = optimizer.init(params)
    checkpointer = Checkpointer(out_dir / "checkpoints", keep=c.keep_checkpoints)
    first_step, state = 1, DataState()
    if resume:
        (params, opt_state), meta = checkpointer.restore_latest((params, opt_state))
        first_step, state = int(meta["step"]) + 1, DataState(**meta["data_state"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p: dict[str, Any], state: optax.OptState, batch: PreferenceBatch):
        (loss, metrics), grads = jax.value_and_grad(
            lambda master: bradley_terry_loss(working_weights(master, config), batch, model_config=config),
            has_aux=True)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, {**metrics, "grad_norm": optax.tree.norm(grads)}

    def evaluate() -> dict[str, float]:
        if evals is None:
            return {}
        return {"eval/pair_accuracy": pair_accuracy(params, config, evals, pad_id, c.sft.eval_batch_size)}

    summary: dict[str, Any] = {}
    logger = RunLogger(out_dir, total_steps=c.steps, initial_step=first_step - 1, tensorboard=c.tensorboard,
                       progress_bar=c.progress_bar, desc="rm", resume_step=first_step - 1 if resume else None)
    if not resume:
        summary["before"] = evaluate()
        if summary["before"]:
            logger.log(0, summary["before"])
        logger.message(f"reward model on {len(train)} preference pairs; held-out pair accuracy before: "
                       f"{summary['before'].get('eval/pair_accuracy', float('nan')):.3f}")
    try:
        for i in range(first_step, c.steps + 1):
            t0 = time.perf_counter()
            idx, state = next_batch_indices(len(train), c.sft.batch_size, state, c.seed, c.data.shuffle)
            params, opt_state, metrics = step(params, opt_state, make_batch(train, idx, pad_id))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            metrics.update({"learning_rate": float(schedule(i - 1)), "time/step": time.perf_counter() - t0})
            if (c.eval_every and i % c.eval_every == 0) or i == c.steps:
                metrics.update(evaluate())
                if i == c.steps:
                    summary["after"] = {k: v for k, v in metrics.items() if k.startswith("eval/")}
            if i % c.log_every == 0 or i == c.steps:
                logger.log(i, metrics)
            logger.progress({"loss": metrics["loss"], "acc": metrics["rewards/accuracies"]})
            if c.checkpoint_every and (i % c.checkpoint_every == 0 or i == c.steps):
                checkpointer.save(i, (params, opt_state), {"step": i, "data_state": dataclasses.asdict(state)})
    finally:
        checkpointer.close()
        logger.close()
    if "after" not in summary:
        summary["after"] = evaluate()
    if c.export:
        summary["export"] = str(save_hf_reward_model(params["decoder"], params["score"], config, export_dir,
                                                     tokenizer_dir=model_dir, pad_token_id=pad_id))
    write_summary(out_dir, summary)
    return summary
