"""Direct preference optimisation (`--algo dpo`) and its relatives (IPO, SLiC hinge, conservative DPO, SimPO).

    collect: the next `sft.batch_size` pairs -> left-padded prompts, right-padded `chosen + EOS` and
             `rejected + EOS` responses (and their precomputed reference log-probs, with dpo.reference=precompute)
    update:  one jitted, data-parallel train_step on `rl.preference.dpo_loss` of the summed response log-probs;
             with dpo.reference=step the frozen reference's log-probs are computed inside that same jit

Data: JSONL (or hf:NAME) with `prompt`, `chosen`, `rejected` (`data.*_field`). A prompt is text or chat messages,
rendered exactly as the policy's prompts are (chat template with the generation prompt, system prompt); a
response is text or chat messages whose last turn is the answer, tokenized as the completion the policy would
sample: `tokens(response) + EOS` (for a chat model, its end-of-turn token). Metrics carry TRL's names
(`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`).
Evaluation: held-out pair accuracy (`data.eval`) and greedy task accuracy (`dpo.eval_prompts`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState, PreferenceSet, bucket, build_preference_set, load_records, next_batch_indices
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, RoutedHidden
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.weights import frozen_copy
from jaxrl_llm.optim import make_optimizer, router_frozen
from jaxrl_llm.rl.preference import dpo_loss
from jaxrl_llm.sampling.padding import left_pad, right_pad
from jaxrl_llm.sharding import init_optimizer_state, train_state_shardings
from jaxrl_llm.trainers.base import Collected, State
from jaxrl_llm.trainers.evaluation import GreedyEvaluation
from jaxrl_llm.trainers.objectives import completion_logprobs, router_terms
from jaxrl_llm.trainers.policy import export_policy, load_policy
from jaxrl_llm.trainers.step import Metrics, jit_one_step_update, state_sharding
from jaxrl_llm.trainers.supervised import ExampleAlgorithm, packed_example_batch


class PairBatch(NamedTuple):
    """Preference pairs: prompts `[B, P]` (left-padded), responses `[B, T]` (right-padded, mask 1 through EOS),
    reference log-probs `[B]` (summed over each response; zeros when the step computes them)."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    chosen_tokens: jax.Array
    chosen_mask: jax.Array
    rejected_tokens: jax.Array
    rejected_mask: jax.Array
    ref_chosen: jax.Array
    ref_rejected: jax.Array
    layout: PackedLayout | None = None  # sft.packing: the `[2B]` chosen-then-rejected sequences' packed rows

    def as_sequences(self) -> Sequences:
        """The pairs as `2B` sequences, the chosen responses then the rejected ones (the prompts repeated)."""
        xp = np if isinstance(self.prompt_tokens, np.ndarray) else jnp
        return Sequences(xp.concatenate([self.prompt_tokens] * 2), xp.concatenate([self.prompt_mask] * 2),
                         xp.concatenate([self.chosen_tokens, self.rejected_tokens]),
                         xp.concatenate([self.chosen_mask, self.rejected_mask]))


@dataclasses.dataclass(frozen=True)
class DPOLossConfig:
    """Static settings of the preference loss (see `rl.preference.dpo_loss`)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference_in_step: bool = True  # the frozen reference's log-probs come from `frozen["reference"]`
    logprob_block_mib: float = 256.0
    router_aux_loss_coef: float = 0.0  # MoE: the load-balancing loss's weight (model.router_aux_loss_coef)


def pair_logprobs(params: Params, config: ModelConfig, batch: PairBatch, *, block_mib: float = 256.0,
                  dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RoutedHidden]:
    """`(sum_t log pi(chosen_t), sum_t log pi(rejected_t), routed)`, each sum `[B]` float32: one forward over both
    sides (`PairBatch.as_sequences`; packed rows with `batch.layout`), `completion_logprobs` masked and summed;
    `routed`: the pass's `decoder.RoutedHidden` (an MoE model's routing)."""
    sequences = batch.as_sequences()
    logp, _, routed = completion_logprobs(params, config, sequences, block_mib=block_mib, dropout_key=dropout_key,
                                          layout=batch.layout)
    sums = (logp * sequences.completion_mask.astype(jnp.float32)).sum(axis=1)
    return sums[: batch.prompt_tokens.shape[0]], sums[batch.prompt_tokens.shape[0]:], routed


def preference_loss(params: Params, batch: PairBatch, *, model_config: ModelConfig, loss_config: DPOLossConfig,
                    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None,
                    dropout_key: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """`dpo_loss` of a (micro-)batch under the `train_step` contract: its mean over pairs scaled by its share of
    the minibatch's pairs (`num_seqs`), so accumulated micro-batches give the minibatch mean."""
    c = loss_config
    chosen, rejected, routed = pair_logprobs(params, model_config, batch, block_mib=c.logprob_block_mib,
                                             dropout_key=dropout_key)
    if c.reference_in_step and c.loss != "simpo":
        ref_chosen, ref_rejected = jax.lax.stop_gradient(
            pair_logprobs(frozen["reference"], model_config, batch, block_mib=c.logprob_block_mib)[:2])
    else:
        ref_chosen, ref_rejected = batch.ref_chosen, batch.ref_rejected
    loss, metrics = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=c.beta, loss_type=c.loss,  # type: ignore[arg-type]
                             label_smoothing=c.label_smoothing, simpo_gamma=c.simpo_gamma,
                             chosen_lengths=batch.chosen_mask.sum(axis=1),
                             rejected_lengths=batch.rejected_mask.sum(axis=1))
    aux, router_metrics = router_terms(routed, model_config, c.router_aux_loss_coef)  # MoE: 0 and {} otherwise
    return (loss + aux) * batch.prompt_tokens.shape[0] / num_seqs, metrics | router_metrics


def pair_batch(pairs: PreferenceSet, indices: np.ndarray, pad_id: int, prompt_bucket: int,
               ref: tuple[np.ndarray, np.ndarray] | None = None) -> PairBatch:
    """The `PairBatch` of `pairs[indices]`: widths rounded up to buckets, so batches reuse compiled steps."""
    prompts = [pairs.prompt_ids[i] for i in indices]
    chosen = [pairs.chosen_ids[i] for i in indices]
    rejected = [pairs.rejected_ids[i] for i in indices]
    pt, pm = left_pad(prompts, bucket(max(map(len, prompts)), prompt_bucket), pad_id)
    width = bucket(max(map(len, chosen + rejected)), 8)
    zeros = np.zeros(len(indices), np.float32)
    ref_c, ref_r = (ref[0][indices], ref[1][indices]) if ref is not None else (zeros, zeros)
    return PairBatch(pt, pm, *right_pad(chosen, width, pad_id), *right_pad(rejected, width, pad_id), ref_c, ref_r)


class DPO(ExampleAlgorithm):
    """The policy trained on preference pairs against a frozen reference (the starting model)."""

    label: ClassVar[str] = "dpo"

    @classmethod
    def held_out_prompts(cls, config: RunConfig) -> str:
        # data.eval holds pairs, scored by the implicit reward's accuracy; greedy answers only to dpo.eval_prompts
        return "dpo.eval_prompts" if config.dpo.eval_prompts else ""

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        c = config
        self.policy = p = load_policy(c)
        self.mesh, self.vocab_size = p.mesh, p.model_config.vocab_size
        encode = functools.partial(build_preference_set, cfg=c.data, tokenizer=p.tokenizer, eos_id=p.eos_ids[0],
                                   max_response_tokens=c.sampling.max_new_tokens)
        self.pairs = encode(*load_records(c.data.train, c.data.split))
        evals = encode(*load_records(c.data.eval, c.data.eval_split)) if c.data.eval else None
        if evals is not None and c.eval_size:
            evals = PreferenceSet(evals.prompt_ids[: c.eval_size], evals.chosen_ids[: c.eval_size],
                                  evals.rejected_ids[: c.eval_size], evals.records[: c.eval_size], evals.num_dropped)
        self.eval_pairs = evals
        self.task_evaluation = GreedyEvaluation(p, c.eval_batch_size, source=c.dpo.eval_prompts)
        d = c.dpo
        self.reference_free = d.loss == "simpo"
        in_step = d.reference == "step" and not self.reference_free
        self.loss_config = DPOLossConfig(loss=d.loss, beta=d.beta, label_smoothing=d.label_smoothing,
                                         simpo_gamma=d.simpo_gamma, reference_in_step=in_step,
                                         logprob_block_mib=c.model.logprob_block_mib,
                                         router_aux_loss_coef=c.model.router_aux_loss_coef)
        model_config, block_mib = p.model_config, c.model.logprob_block_mib
        self.logprob_fn = jax.jit(lambda params, batch: pair_logprobs(params, model_config, batch,
                                                                      block_mib=block_mib)[:2])
        # The reference is the starting model: a frozen copy, or under LoRA the base itself (adapters off).
        reference = None if self.reference_free else p.base if p.base is not None else frozen_copy(p.initial_params,
                                                                                                   p.model_config)
        self.eval_ref = self._reference_logprobs(reference, self.eval_pairs) if evals is not None else None
        self.train_ref = (self._reference_logprobs(reference, self.pairs)
                          if d.reference == "precompute" and reference is not None else None)
        frozen = {**(p.frozen or {}), **({"reference": reference} if in_step else {})}
        self.frozen = frozen or None
        self.optimizer, self.schedule = make_optimizer(c.optim, max(c.steps, 1), router_frozen(c.model.freeze_router))
        self.frozen_input = self.frozen
        self.update_fn = jit_one_step_update(
            p.mesh, train_state_shardings(self.optimizer, p.initial_params, p.params_sharding, p.mesh),
            frozen_sharding=state_sharding(self.frozen) if self.frozen else None,
            with_key=p.lora_dropout, loss_fn=preference_loss, model_config=p.model_config,
            loss_config=self.loss_config, optimizer=self.optimizer, grad_accum=1, compose=p.compose)

    def init(self) -> State:
        p = self.policy
        return {"params": p.initial_params,
                "opt_state": init_optimizer_state(self.optimizer, p.initial_params, p.params_sharding, p.mesh)}

    def _batches(self, pairs: PreferenceSet, ref: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        size = self.config.sft.eval_batch_size
        for start in range(0, len(pairs), size):
            idx = np.arange(start, min(start + size, len(pairs)))
            yield idx, pair_batch(pairs, idx, self.policy.pad_id, self.config.sampling.prompt_bucket, ref)

    def _logprobs(self, params: Params, pairs: PreferenceSet) -> tuple[np.ndarray, np.ndarray]:
        chosen, rejected = np.zeros(len(pairs), np.float32), np.zeros(len(pairs), np.float32)
        for idx, batch in self._batches(pairs):
            c, r = jax.device_get(self.logprob_fn(params, batch))
            chosen[idx], rejected[idx] = c, r
        return chosen, rejected

    def _reference_logprobs(self, reference: Params | None, pairs: PreferenceSet) -> tuple[np.ndarray, np.ndarray]:
        if reference is None:
            zeros = np.zeros(len(pairs), np.float32)
            return zeros, zeros
        return self._logprobs(reference, pairs)

    def describe(self) -> str:
        c = self.config
        where = {"step": "in each step", "precompute": "precomputed"}[c.dpo.reference]
        reference = "no reference (reference-free)" if self.reference_free else f"reference log-probs {where}"
        return (f"DPO ({c.dpo.loss}, beta {c.dpo.beta:g}) on {len(self.pairs)} preference pairs "
                f"({self.pairs.num_dropped} dropped as too long), {reference}")

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        c = self.config
        idx, data_state = next_batch_indices(len(self.pairs), c.sft.batch_size, data_state, c.seed, c.data.shuffle)
        batch = pair_batch(self.pairs, idx, self.policy.pad_id, c.sampling.prompt_bucket, self.train_ref)
        valid = batch.as_sequences().inputs()[1] > 0
        packed, metrics = packed_example_batch(batch, valid, batch.prompt_mask.shape[1], packing=c.sft.packing,
                                               mesh=self.mesh, num_params=self.policy.model_config.num_params(),
                                               min_gflops=c.sft.packing_min_gflops)
        return Collected(packed, data_state, metrics)

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        out: dict[str, float] = {}
        weights = self.policy.model_weights(state["params"])
        if self.eval_pairs is not None and self.eval_ref is not None:
            chosen, rejected = self._logprobs(weights, self.eval_pairs)
            d = self.config.dpo
            lengths = [np.asarray([len(x) for x in side], np.float32)
                       for side in (self.eval_pairs.chosen_ids, self.eval_pairs.rejected_ids)]
            _, m = dpo_loss(chosen, rejected, *self.eval_ref, beta=d.beta, loss_type=d.loss,  # type: ignore[arg-type]
                            label_smoothing=d.label_smoothing, simpo_gamma=d.simpo_gamma,
                            chosen_lengths=lengths[0], rejected_lengths=lengths[1])
            out["eval/reward_accuracy"] = float(m["rewards/accuracies"])
            out["eval/reward_margin"] = float(m["rewards/margins"])
            out["eval/logp_accuracy"] = float(np.mean(chosen > rejected))  # the policy itself prefers chosen
        out.update(self.task_evaluation(weights, limit))
        return out

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["loss"], "acc": metrics["rewards/accuracies"], "margin": metrics["rewards/margins"]}

    def export(self, state: State, directory: Path) -> str:
        return export_policy(self.policy, state["params"], directory)
