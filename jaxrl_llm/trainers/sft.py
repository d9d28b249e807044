"""Supervised fine-tuning (`--algo sft`): cross-entropy on answer tokens, from a HF model or from scratch.

    collect: the next `sft.batch_size` examples -> left-padded prompts, right-padded `answer + EOS` targets
    update:  one jitted, data-parallel train_step on `-sum_t log pi(y_t) / num_tokens`

This is how the default task's base model is made: `python train.py --algo sft --config
configs/sft_arithmetic.yaml` trains a small Llama from random weights on the arithmetic task for a fixed,
deliberately short budget, so its greedy held-out accuracy is well below 100% and RL has room to improve it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import jax
import numpy as np

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState, PromptSet, bucket, next_batch_indices
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.optim import make_optimizer, router_frozen
from jaxrl_llm.sampling.padding import left_pad, right_pad
from jaxrl_llm.sharding import init_optimizer_state, train_state_shardings
from jaxrl_llm.trainers.base import Collected, State
from jaxrl_llm.trainers.evaluation import GreedyEvaluation
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, sft_loss
from jaxrl_llm.trainers.policy import export_policy, load_policy
from jaxrl_llm.trainers.step import jit_one_step_update
from jaxrl_llm.trainers.supervised import ExampleAlgorithm, packed_example_batch


def completion_arrays(prompt_set: PromptSet, indices: np.ndarray, tokenizer: Any, answer_field: str,
                      eos_id: int, pad_id: int) -> Sequences:
    """Left-padded prompts and right-padded `answer + EOS` targets `[B, P]`, `[B, T]` (bucketed widths)."""
    prompts = [prompt_set.token_ids[i] for i in indices]
    answers = [tokenizer(str(prompt_set.records[i][answer_field]), add_special_tokens=False)["input_ids"] + [eos_id]
               for i in indices]
    pt, pm = left_pad(prompts, bucket(max(map(len, prompts))), pad_id)
    ct, cm = right_pad(answers, bucket(max(map(len, answers)), 8), pad_id)
    return Sequences(pt, pm, ct, cm)


class SFT(ExampleAlgorithm):
    """Cross-entropy on the answers of `data.train` (`data.answer_field`). State: `{"params", "opt_state"}`."""

    label: ClassVar[str] = "sft"
    evaluates_before: ClassVar[bool] = False
    from_scratch: ClassVar[bool] = True  # model.init: random weights, no model directory read

    @classmethod
    def validate(cls, c: RunConfig) -> None:
        if c.lora.rank and c.model.init:
            raise ConfigError(f"lora.rank={c.lora.rank} with algo=sft and model.init: LoRA adapts a pretrained "
                              f"model (model.path); set lora.rank=0")

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        c = config
        self.policy = p = load_policy(c, from_scratch=True)
        self.mesh, self.vocab_size = p.mesh, p.model_config.vocab_size
        self.examples = p.prompt_set(c.data.train, c.data.split)
        self.evaluation = GreedyEvaluation(p, c.sft.eval_batch_size)
        self.optimizer, self.schedule = make_optimizer(c.optim, max(c.steps, 1), router_frozen(c.model.freeze_router))
        self.frozen_input = self.policy.frozen
        self.update_fn = jit_one_step_update(
            p.mesh, train_state_shardings(self.optimizer, p.initial_params, p.params_sharding, p.mesh),
            frozen_sharding=p.frozen_sharding, with_key=p.lora_dropout, loss_fn=sft_loss,
            model_config=p.model_config, loss_config=PolicyObjective(logprob_block_mib=c.model.logprob_block_mib,
                                                                    router_aux_loss_coef=c.model.router_aux_loss_coef),
            optimizer=self.optimizer, grad_accum=1, compose=p.compose)

    def init(self) -> State:
        p = self.policy
        return {"params": p.initial_params,
                "opt_state": init_optimizer_state(self.optimizer, p.initial_params, p.params_sharding, p.mesh)}

    def describe(self) -> str:
        m = self.policy.model_config
        return f"SFT of a {m.num_params() / 1e6:.2f}M-parameter {m.model_type} on {len(self.examples)} examples"

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        c, p = self.config, self.policy
        indices, data_state = next_batch_indices(len(self.examples), c.sft.batch_size, data_state, c.seed,
                                                 c.data.shuffle)
        sequences = completion_arrays(self.examples, indices, p.tokenizer, c.data.answer_field, p.eos_ids[0],
                                      p.pad_id)
        zeros = np.zeros(sequences.completion_tokens.shape, np.float32)
        batch = PolicyBatch(sequences, zeros, zeros, np.zeros(len(zeros), np.float32))
        valid = sequences.inputs()[1] > 0
        packed, metrics = packed_example_batch(batch, valid, sequences.prompt_width, packing=c.sft.packing,
                                               mesh=self.mesh, num_params=self.policy.model_config.num_params(),
                                               min_gflops=c.sft.packing_min_gflops)
        return Collected(packed, data_state, metrics)

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        return self.evaluation(self.policy.inference_weights(state["params"]), limit)

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["sft_loss"]}

    def export(self, state: State, directory: Path) -> str:
        return export_policy(self.policy, state["params"], directory)
