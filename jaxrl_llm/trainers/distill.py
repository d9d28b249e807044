"""On-policy distillation (`--algo distill`): a student learns from a frozen teacher on its own samples.

    collect:  P prompts x G samples from the student, scored by the run's rewards (trainers/rollouts.py), as
              the GRPO family samples, single- or multi-turn; GKD's off-policy steps (`distill.lmbda`) take the
              data's answers instead
    update:   distill.loss=reverse_kl: the teacher's log-probs of the sampled tokens (a frozen forward pass,
              sharded like the reference model) -> per-token advantages `kl_coef (log pi_T - log pi_S)`
              (+ `reward_weight` x the GRPO advantage of the rewards) -> the GRPO update (clipped surrogate,
              `rl.*`); distill.loss=jsd: GKD's generalised JSD to the teacher over the full vocabulary, the teacher
              run inside the same jitted step

Formulas: `jaxrl_llm.rl.distillation` and docs/algorithms.md. The teacher must share the student's tokenizer (the
same vocabulary, token for token); any supported family and size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxrl_llm.config import RunConfig
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, completion_hidden, unembedding_as_stored
from jaxrl_llm.models.hf import load_hf_model, resolve_model_dir
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.models.weights import frozen_copy
from jaxrl_llm.rl.distillation import generalized_jsd_from_hidden, reverse_kl_advantages
from jaxrl_llm.rl.reductions import masked_mean
from jaxrl_llm.trainers.base import Algorithm, Collected
from jaxrl_llm.trainers.grpo import GRPOFamily, validate_grpo
from jaxrl_llm.trainers.objectives import (
    Metrics,
    PolicyBatch,
    logprob_chunk_size,
    make_logprob_fn,
    router_terms,
)
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.rl import logprob_pass_layout
from jaxrl_llm.trainers.rollouts import Rollout, rollout_tokens


def validate_distill(c: RunConfig) -> None:
    """The GRPO family's checks, and the settings the JSD loss cannot take."""
    validate_grpo(c)
    d = c.distill
    if not d.teacher:
        raise ConfigError("distill.teacher is empty: --algo distill needs the teacher's model directory or hub id")
    if d.loss == "jsd":
        if c.rl.beta:
            raise ConfigError(f"rl.beta={c.rl.beta} with distill.loss=jsd: the JSD to the teacher is the whole "
                              f"loss (no KL term to a reference); set rl.beta=0")
        if c.rl.entropy_target:
            raise ConfigError(f"rl.entropy_target={c.rl.entropy_target} with distill.loss=jsd: the JSD loss has "
                              f"no entropy term; set rl.entropy_target=0")
        if c.env.name and d.lmbda < 1:
            raise ConfigError(f"distill.lmbda={d.lmbda} with env.name={c.env.name}: the off-policy steps train on "
                              f"the data's single-turn answers; set distill.lmbda=1 for multi-turn episodes")
        if d.reward_weight:
            raise ConfigError(f"distill.reward_weight={d.reward_weight} with distill.loss=jsd: only reverse_kl "
                              f"mixes in the task reward; set distill.reward_weight=0")


def load_teacher(c: RunConfig, policy: Policy) -> tuple[ModelConfig, Params]:
    """The teacher (`distill.teacher`) on the student's mesh, frozen in `model.param_dtype` (sharded like the
    reference model), after checking that it reads the student's tokens: the same vocabulary, token for token,
    and (for the JSD over the full vocabulary) the same output size."""
    where = f"distill.teacher={c.distill.teacher}"
    directory = resolve_model_dir(c.distill.teacher)
    if load_tokenizer(directory).get_vocab() != policy.tokenizer.get_vocab():
        raise ConfigError(f"{where}: its tokenizer's vocabulary differs from the student's (model.path="
                          f"{c.model.path}); distillation scores the student's tokens with the teacher, so both "
                          f"must share one tokenizer")
    m = c.model
    config, params = load_hf_model(directory, mesh=policy.mesh, dtype=m.dtype, param_dtype=m.param_dtype,
                                   remat=m.remat, scan_unroll=m.scan_unroll,
                                   attention_query_chunk=m.attention_query_chunk)
    if c.distill.loss == "jsd" and config.vocab_size != policy.model_config.vocab_size:
        raise ConfigError(f"{where}: {config.vocab_size} output logits, the student has "
                          f"{policy.model_config.vocab_size}; distill.loss=jsd compares full distributions (use "
                          f"distill.loss=reverse_kl, which needs only the shared tokens)")
    return config, frozen_copy(params, config)


@dataclasses.dataclass(frozen=True)
class JSDObjective:
    """GKD's loss settings (static in the jitted update): the teacher's architecture, `distill.beta`, the sampling
    temperature both distributions are taken at, and the memory of one logits block (`model.logprob_block_mib`)."""

    teacher: ModelConfig
    beta: float = 0.5
    temperature: float = 1.0
    logprob_block_mib: float = 256.0
    router_aux_loss_coef: float = 0.0  # an MoE student: the load-balancing loss's weight (model.router_aux_loss_coef)


def jsd_loss(params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: JSDObjective,
             num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
             ) -> tuple[jax.Array, Metrics]:
    """GKD's loss of one (micro-)batch: `sum_t m_t JSD_beta(p_T, p_S)(x, y_<t) / num_tokens` (token-mean over
    the minibatch, as TRL's `batchmean` over the completion tokens), the teacher (`frozen["teacher"]`) run in
    the same pass without gradients; packed rows (`batch.layout`) serve both models."""
    c, t = loss_config, frozen["teacher"]
    routed = completion_hidden(params, model_config, batch.sequences, layout=batch.layout, dropout_key=dropout_key)
    hidden = routed.hidden
    teacher_hidden = jax.lax.stop_gradient(completion_hidden(t, c.teacher, batch.sequences, layout=batch.layout).hidden)
    n, length = batch.sequences.completion_tokens.shape
    (student_w, student_transposed), (teacher_w, teacher_transposed) = (unembedding_as_stored(params, model_config),
                                                                          unembedding_as_stored(t, c.teacher))
    jsd = generalized_jsd_from_hidden(
        hidden, student_w, teacher_hidden, teacher_w, beta=c.beta, temperature=c.temperature,
        student_transposed=student_transposed, teacher_transposed=teacher_transposed,
        chunk_size=logprob_chunk_size(n, length, model_config.vocab_size, c.logprob_block_mib / 2),
        student_softcap=model_config.final_logit_softcap, teacher_softcap=c.teacher.final_logit_softcap,
        compute_dtype=model_config.jnp_dtype)
    mask = batch.sequences.targets_mask().astype(jnp.float32)
    loss = (jsd * mask).sum() / jnp.maximum(num_tokens, 1.0)
    aux, router_metrics = router_terms(routed, model_config, c.router_aux_loss_coef, layout=batch.layout)
    # a masked mean of this micro-batch: the step's token-count weights make it the minibatch's
    return loss + aux * (mask.sum(axis=1) > 0).sum() / jnp.maximum(num_seqs, 1.0), {
        "distill/jsd": masked_mean(jsd, mask), "distill/jsd/max": jnp.max(jnp.where(mask > 0, jsd, 0.0)),
        **router_metrics}


class Distillation(GRPOFamily):
    """The student trained toward a frozen teacher on its own samples (module docstring). State: as GRPO's."""

    label: ClassVar[str] = "distill"

    @classmethod
    def validate(cls, c: RunConfig) -> None:
        validate_distill(c)

    @classmethod
    def model_sources(cls, config: RunConfig) -> dict[str, str]:
        return {"distill.teacher": config.distill.teacher}

    @classmethod
    def teacher(cls, config: RunConfig) -> tuple[str, bool]:
        return config.distill.teacher, config.distill.loss == "jsd"  # GKD's JSD reads the teacher in the update

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        c, d, p = config, config.distill, self.policy
        self.teacher_config, self.teacher = load_teacher(c, p)
        teacher_sharding = jax.tree.map(lambda x: x.sharding, self.teacher)
        if d.loss == "jsd":  # the teacher runs inside the update: a frozen input beside LoRA's base
            self.loss_fn = jsd_loss
            self.objective = JSDObjective(self.teacher_config, d.beta, c.sampling.temperature,
                                          c.model.logprob_block_mib, c.model.router_aux_loss_coef)
            self.frozen_input = {**(p.frozen or {}), "teacher": self.teacher}
            self.frozen_sharding = {**(p.frozen_sharding or {}), "teacher": teacher_sharding}
            self.update_fns = {}
            self.update_fn = self.update_fn_for(c.rl.grad_accum)
        else:
            self.teacher_logprob_fn = make_logprob_fn(p.mesh, self.teacher_config, c.sampling.temperature,
                                                      teacher_sharding, block_mib=c.model.logprob_block_mib)

    def describe(self) -> str:
        d = self.config.distill
        how = (f"reverse KL (kl_coef {d.kl_coef}, reward_weight {d.reward_weight})" if d.loss == "reverse_kl"
               else f"GKD JSD (beta {d.beta}, lmbda {d.lmbda})")
        return (f"{super().describe()}; teacher {d.teacher} ({self.teacher_config.num_params() / 1e6:.2f}M "
                f"params), {how}")

    def sample_with(self, weights: Any, data_state: Any, key: jax.Array) -> tuple[Any, Callable[[], Collected]]:
        # GKD draws samples or the data's answers inside `collect_with`: all of it in the sampler's thread
        return Algorithm.sample_with(self, weights, data_state, key)

    def collect_with(self, weights: Any, data_state: Any, key: jax.Array) -> Collected:
        """The student's samples, or (GKD, with probability `1 - distill.lmbda`, drawn from the step's key) the
        data's answers."""
        d = self.config.distill
        on_policy = d.loss != "jsd" or d.lmbda >= 1 or float(jax.random.uniform(jax.random.fold_in(key, 7))) < d.lmbda
        if on_policy:
            collected = super().collect_with(weights, data_state, key)
        else:
            ro, data_state = self.collector.answer_rollout(data_state)
            collected = Collected(ro, data_state, self.collector.metrics(ro, 0), rollout_tokens(ro))
        collected.metrics["distill/on_policy"] = float(on_policy)
        return collected

    def token_advantages(self, ro: Rollout, sequences: Sequences, old_logp: jax.Array, ref_logp: jax.Array
                         ) -> tuple[jax.Array, dict[str, float]]:
        """reverse_kl: `kl_coef (log pi_T - log pi_old)` per token, plus `reward_weight` x the estimator's
        advantages of the rewards; jsd: none (its loss reads the teacher itself)."""
        d = self.config.distill
        if d.loss == "jsd":
            return jnp.zeros_like(old_logp), {}
        layout = logprob_pass_layout(self.config, ro, self.mesh, self.teacher_config.num_params())
        teacher_logp = self.teacher_logprob_fn(self.teacher, sequences, layout)
        loss_mask = sequences.targets_mask()
        advantages = reverse_kl_advantages(old_logp, teacher_logp, loss_mask, coef=d.kl_coef)
        if d.reward_weight:
            task, _ = super().token_advantages(ro, sequences, old_logp, ref_logp)
            advantages = advantages + d.reward_weight * task
        m = loss_mask.astype(jnp.float32)
        stats = jax.device_get({"distill/reverse_kl": masked_mean(old_logp - teacher_logp, m),
                                "distill/teacher_logp": masked_mean(teacher_logp, m)})
        return advantages, {k: float(v) for k, v in stats.items()}
