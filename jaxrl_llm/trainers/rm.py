"""Reward-model training (`--algo rm`): Bradley-Terry on preference pairs, exported as a HF classifier.

    loss = -log sigmoid(r(x, y_chosen) - r(x, y_rejected))          (Bradley & Terry 1952; Ouyang et al. 2022)

with `r` the score at the last token of `prompt + response` (`models/reward_model.sequence_scores`). The
model starts from a causal LM's decoder (`model.path`) with a fresh score head, or from a classifier's own
head. Data: JSONL with `prompt`, `chosen`, `rejected` (`data.chosen_field` / `data.rejected_field`);
`python -m jaxrl_llm data arithmetic` writes such pairs for the default task (the true answer over a
wrong one). The update is the same jitted, data-parallel `train_step` as every other algorithm's. The result
is a `...ForSequenceClassification` directory that transformers loads and the `reward_model` reward uses.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState, bucket, encode_text, load_records, next_batch_indices, pair_texts
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.hf import is_classifier, load_hf_model, read_tensor, resolve_model_dir
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.reward_model import save_hf_reward_model, sequence_scores
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.models.weights import master_weights
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.rl.preference import dpo_loss
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.sharding import (
    MeshShape,
    init_optimizer_state,
    make_mesh,
    param_shardings,
    to_host,
    train_state_shardings,
)
from jaxrl_llm.trainers.base import Collected, State
from jaxrl_llm.trainers.step import Metrics, jit_one_step_update, state_sharding
from jaxrl_llm.trainers.supervised import ExampleAlgorithm, packed_example_batch


class PreferenceBatch(NamedTuple):
    """Left-padded `prompt + response` token ids and masks `[B, T]` for both sides of each pair."""

    chosen_tokens: jax.Array
    chosen_mask: jax.Array
    rejected_tokens: jax.Array
    rejected_mask: jax.Array
    layout: PackedLayout | None = None  # sft.packing: the `[2B]` chosen-then-rejected rows packed, else None


def bradley_terry_loss(params: dict[str, Any], batch: PreferenceBatch, *,
                       model_config: ModelConfig) -> tuple[jax.Array, Metrics]:
    """`mean_i -log sigmoid(r_chosen_i - r_rejected_i)` and DPO-style metrics (accuracy, margins).

    This is `dpo_loss` with `beta = 1` and a zero reference: the "implicit rewards" are the scores themselves.
    """
    score = functools.partial(sequence_scores, params["decoder"], params["score"], model_config)
    if batch.layout is None:
        chosen = score(batch.chosen_tokens, batch.chosen_mask)[:, 0]
        rejected = score(batch.rejected_tokens, batch.rejected_mask)[:, 0]
    else:  # both sides in one packed forward pass
        both = score(jnp.concatenate([batch.chosen_tokens, batch.rejected_tokens]),
                     jnp.concatenate([batch.chosen_mask, batch.rejected_mask]), batch.layout)[:, 0]
        chosen, rejected = both[: batch.chosen_tokens.shape[0]], both[batch.chosen_tokens.shape[0]:]
    zeros = jnp.zeros_like(chosen)
    return dpo_loss(chosen, rejected, zeros, zeros, beta=1.0, loss_type="sigmoid")


def pair_loss(params: dict[str, Any], batch: PreferenceBatch, *, model_config: ModelConfig, loss_config: Any,
              num_tokens: jax.Array, num_seqs: jax.Array) -> tuple[jax.Array, Metrics]:
    """`bradley_terry_loss` under the `train_step` contract: a micro-batch's summed loss over the whole
    minibatch's pair count (`num_seqs`), so accumulated micro-batches give the full-batch mean."""
    loss, metrics = bradley_terry_loss(params, batch, model_config=model_config)
    return loss * batch.chosen_tokens.shape[0] / num_seqs, metrics


def encode_pairs(records: list[dict[str, Any]], label: str, tokenizer: Any,
                 c: RunConfig) -> list[tuple[list[int], ...]]:
    """`(chosen ids, rejected ids)` of each pair's whole text (`data.pair_texts`: `prompt + response`, or the chat
    template's rendering with the response as the assistant turn), no special tokens added, as
    `RewardModel` scores."""
    return [tuple(encode_text(tokenizer, text, add_special_tokens=False) for text in texts)
            for texts in pair_texts(records, label, c.data, tokenizer)]


def make_batch(pairs: list[tuple[list[int], ...]], indices: np.ndarray, pad_id: int) -> PreferenceBatch:
    chosen = [pairs[i][0] for i in indices]
    rejected = [pairs[i][1] for i in indices]
    width = bucket(max(map(len, chosen + rejected)))
    return PreferenceBatch(*left_pad(chosen, width, pad_id), *left_pad(rejected, width, pad_id))


def initial_reward_model(c: RunConfig, mesh: Any) -> tuple[ModelConfig, dict[str, Any], Path]:
    """Decoder from `model.path` (its lm head dropped) and a score head: the classifier's, or N(0, 0.02)."""
    model_dir = resolve_model_dir(c.model.path)
    config, decoder = load_hf_model(model_dir, tie_word_embeddings=True, dtype=c.model.dtype, mesh=mesh,
                                    param_dtype=c.model.param_dtype, remat=c.model.remat,
                                    scan_unroll=c.model.scan_unroll,
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
    def accuracy(p: dict[str, Any], batch: PreferenceBatch) -> jax.Array:
        return bradley_terry_loss(p, batch, model_config=config)[1]["rewards/accuracies"]

    correct = 0.0
    for start in range(0, len(pairs), batch_size):
        idx = np.arange(start, min(start + batch_size, len(pairs)))
        correct += float(accuracy(params, make_batch(pairs, idx, pad_id))) * len(idx)
    return correct / len(pairs)


class RewardModelTraining(ExampleAlgorithm):
    """A scalar reward model trained on preference pairs. State: `{"params": {"decoder", "score"}, "opt_state"}`."""

    label: ClassVar[str] = "rm"

    @classmethod
    def held_out_prompts(cls, config: RunConfig) -> str:
        return ""  # data.eval holds pairs, scored by the model's own pair accuracy

    @classmethod
    def validate(cls, c: RunConfig) -> None:
        if c.lora.rank:
            raise ConfigError(f"lora.rank={c.lora.rank} with algo=rm: LoRA adapts a pretrained policy (GRPO family, "
                              f"PPO, DPO, SFT from model.path); set lora.rank=0")

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        c = config
        if jax.process_count() > 1:
            raise ConfigError("--algo rm runs in a single process (its evaluation is not sharded across hosts); "
                              "unset distributed.enabled / JAX_COORDINATOR_ADDRESS")
        # mesh.sequence: the devices check_devices counted; the reward model's rows are copies along that axis
        self.mesh = make_mesh(MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor, expert=c.mesh.expert,
                                        sequence=c.mesh.sequence))
        self.model_config, params, self.model_dir = initial_reward_model(c, self.mesh)
        self.vocab_size = self.model_config.vocab_size
        self.initial_params = jax.device_put(params, param_shardings(params, self.mesh))
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.pairs = encode_pairs(*load_records(c.data.train, c.data.split), self.tokenizer, c)
        evals = encode_pairs(*load_records(c.data.eval, c.data.eval_split), self.tokenizer, c) if c.data.eval else None
        self.eval_pairs = evals[: c.eval_size] if evals is not None and c.eval_size else evals
        self.optimizer, self.schedule = make_optimizer(c.optim, max(c.steps, 1))
        shardings = train_state_shardings(self.optimizer, self.initial_params, state_sharding(self.initial_params),
                                          self.mesh)
        self.update_fn = jit_one_step_update(self.mesh, shardings, loss_fn=pair_loss, model_config=self.model_config,
                                             loss_config=None, optimizer=self.optimizer, grad_accum=1)

    def init(self) -> State:
        params = self.initial_params
        return {"params": params,
                "opt_state": init_optimizer_state(self.optimizer, params, state_sharding(params), self.mesh)}

    def describe(self) -> str:
        return f"reward model on {len(self.pairs)} preference pairs"

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        c = self.config
        idx, data_state = next_batch_indices(len(self.pairs), c.sft.batch_size, data_state, c.seed, c.data.shuffle)
        batch = make_batch(self.pairs, idx, self.pad_id)
        mask = np.concatenate([batch.chosen_mask, batch.rejected_mask]) > 0
        # The inputs are the whole left-padded sequences, read as prompts of their full width: the layout's one
        # "completion token" per row is predicted at the last column, each sequence's last token, where it is scored.
        packed, metrics = packed_example_batch(batch, mask, mask.shape[1], packing=c.sft.packing,
                                               mesh=self.mesh, num_params=self.model_config.num_params(),
                                               min_gflops=c.sft.packing_min_gflops)
        return Collected(packed, data_state, metrics)

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        if self.eval_pairs is None:
            return {}
        return {"eval/pair_accuracy": pair_accuracy(state["params"], self.model_config, self.eval_pairs, self.pad_id,
                                                    self.config.sft.eval_batch_size)}

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["loss"], "acc": metrics["rewards/accuracies"]}

    def export(self, state: State, directory: Path) -> str:
        params = to_host(state["params"])
        return str(save_hf_reward_model(params["decoder"], params["score"], self.model_config, directory,
                                        tokenizer_dir=self.model_dir, pad_token_id=self.pad_id))
