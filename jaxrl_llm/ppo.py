"""PPO with a learned critic and GAE (`--algo ppo`), on the GRPO trainer's loop.

One step, in the order the data flows (Ziegler et al. 2019; Ouyang et al. 2022; Schulman et al. 2017)::

    prompts -> sample (jit) -> scores (host)                                      [GRPOTrainer.collect]
    V_t        = critic(x, y_<t)                                       [N, T]   values of the rollout (jit)
    r_t        = -beta * KL_t(pi_old || pi_ref) + [t = last] * score   [N, T]   KL (k1) in the reward
    A_t, R_t   = GAE(r, V; gamma, lambda),  R_t = A_t + V_t           [N, T]   (whitened A if configured)
    mu epochs x minibatches:
        policy:  clipped surrogate on A_t (+ entropy bonus), beta = 0 in the loss     (train_step, jit)
        critic:  0.5 * max((V - R)^2, (V_clip - R)^2),  V_clip = V_old + clip(V - V_old, +-value_clip)
    beta <- KL controller(beta, mean KL per token)                         fixed, or adaptive if kl_target > 0

The critic is a decoder of its own plus a scalar head (`models/heads.py`), initialised from the policy (a copy,
zero head) or from a model directory such as a reward model's, and trained by its own AdamW. Both updates are
the same jitted, data-parallel `train_step` (batch on the `data` axis, params replicated and donated) with a
different loss function. The critic, its optimizer state and the KL coefficient are checkpointed with the
policy, so `--resume` continues a PPO run exactly where it stopped.

The loop knobs (prompts_per_step, group_size, mu, minibatch_size, grad_accum, epsilons, entropy_coef,
loss_aggregation) are read from `config.grpo`; the PPO-only ones from `config.ppo`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_llm.config import ConfigError, RunConfig
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.heads import CriticParams, critic_from_policy, critic_values, load_critic
from jaxrl_llm.rl.advantages import gae_advantages, masked_whiten
from jaxrl_llm.rl.kl_control import KLControllerState, adaptive_kl_update, fixed_kl_update, init_kl_controller
from jaxrl_llm.rl.logprobs import masked_mean
from jaxrl_llm.rl.losses import KLEstimator, clipped_value_loss, explained_variance, kl_penalty, kl_shaped_token_rewards
from jaxrl_llm.sharding import batch_sharding, global_array, init_optimizer_state, param_shardings, to_host
from jaxrl_llm.train_step import (
    Metrics,
    PolicyBatch,
    frozen_copy,
    make_optimizer,
    make_train_step,
    master_weights,
    policy_loss,
)
from jaxrl_llm.trainer import GRPOTrainer, Rollout

# --------------------------------------------------------------------------------------------------------
# Pure pieces
# --------------------------------------------------------------------------------------------------------


class PPOTargets(NamedTuple):
    """What a rollout turns into before the updates; every field `[N, T]` float32, 0 at padding.

    kl: `KL_t` per token (old policy vs reference); token_rewards: `r_t`; advantages: `A_t` (whitened if
    asked); returns: `R_t = A_t + V_t` (from the raw, un-whitened advantages): the critic's target.
    """

    kl: jax.Array
    token_rewards: jax.Array
    advantages: jax.Array
    returns: jax.Array


def ppo_targets(
    scores: jax.Array,
    old_logp: jax.Array,
    ref_logp: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    kl_coef: jax.Array | float,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_estimator: KLEstimator = "k1",
    whiten_advantages: bool = True,
) -> PPOTargets:
    """Per-token rewards, GAE advantages and returns of one rollout.

    ::

        KL_t  = kl_penalty(old_logp, ref_logp)             k1: log pi_old(y_t) - log pi_ref(y_t)
        r_t   = -kl_coef * KL_t + [t = last valid] * score
        delta_t = r_t + gamma * V_{t+1} - V_t               (V after the last token = 0)
        A_t   = delta_t + gamma * lam * A_{t+1},   R_t = A_t + V_t
        A_t   <- (A_t - mean A) / sqrt(var A + 1e-8)         over all valid tokens, if whiten_advantages

    Shapes: `scores [N]`; `old_logp, ref_logp, values, mask [N, T]`; `kl_coef` a scalar (may be traced).
    """
    kl = kl_penalty(old_logp, ref_logp, estimator=kl_estimator, mask=mask)
    token_rewards = kl_shaped_token_rewards(scores, old_logp, ref_logp, mask, kl_coef=kl_coef, estimator=kl_estimator)
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    return PPOTargets(kl, token_rewards, advantages, returns)


def rollout_value_metrics(targets: PPOTargets, values: jax.Array, mask: jax.Array) -> Metrics:
    """Scalars of a rollout before any update: `kl` (mean per token), `returns/mean`, `values/mean`,
    `explained_variance` of the rollout's values against the returns, `token_reward/sum_mean` (mean over
    sequences of sum_t r_t). Shapes: `values, mask [N, T]`."""
    valid = mask.astype(jnp.float32)
    has_tokens = (valid.sum(axis=-1) > 0).astype(jnp.float32)
    return {
        "kl": masked_mean(targets.kl, mask),
        "returns/mean": masked_mean(targets.returns, mask),
        "values/mean": masked_mean(values, mask),
        "explained_variance": explained_variance(values, targets.returns, mask),
        "token_reward/sum_mean": (targets.token_rewards * valid).sum() / jnp.maximum(has_tokens.sum(), 1.0),
    }


class CriticBatch(NamedTuple):
    """One minibatch for the critic: prompt_tokens/prompt_mask `[N, P]`, completion_tokens/completion_mask
    `[N, T]`, old_values (the rollout's `V_t`) and returns (`R_t`) `[N, T]` float32."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    old_values: jax.Array
    returns: jax.Array


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
    """Static knobs of the critic loss: `clip_range` (None = no value clipping) and the aggregation mode."""

    clip_range: float | None = 0.2
    aggregation: str = "token-mean"
    max_len: int | None = None


def critic_loss(
    critic: CriticParams,
    batch: CriticBatch,
    *,
    model_config: ModelConfig,
    loss_config: ValueLossConfig,
    num_tokens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[jax.Array, Metrics]:
    """`clipped_value_loss(V, V_old, R)` of one (micro-)batch, normalised by the whole minibatch's counts
    (the `train_step` contract); metrics `value_loss`, `value_clip_fraction`."""
    values = critic_values(critic, model_config, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens,
                           batch.completion_mask)
    loss, metrics = clipped_value_loss(
        values, batch.old_values, batch.returns, batch.completion_mask,
        clip_range=loss_config.clip_range,
        aggregation=loss_config.aggregation,  # type: ignore[arg-type]
        max_len=loss_config.max_len,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    return loss, {"value_loss": metrics["value_loss"], "value_clip_fraction": metrics["value_clip_fraction"]}


def kl_controller_step(state: KLControllerState, mean_kl: float, n_samples: int, *, target: float,
                       horizon: float) -> KLControllerState:
    """Adaptive (Ziegler et al. 2019) if `target > 0`, else fixed: `beta` stays `kl_coef_init`."""
    if target > 0:
        return adaptive_kl_update(state, mean_kl, n_samples, target=target, horizon=horizon)
    return fixed_kl_update(state, mean_kl, n_samples)


# --------------------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------------------


class PPOTrainer(GRPOTrainer):
    """GRPOTrainer's loop (collect, evaluation, logging, checkpoints) with a critic, GAE and KL in the reward."""

    def __init__(self, config: RunConfig, *, resume: bool = False, overwrite: bool = False,
                 allow_config_change: bool = False) -> None:
        # The restore comes below, once the critic's state exists.
        super().__init__(config, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                         restore=False)
        try:
            self._build_critic(resume)
        except BaseException:
            self.run_dir.release()
            raise

    def _build_critic(self, resume: bool) -> None:
        c, g, p = self.config, self.config.grpo, self.config.ppo
        # KL to the reference lives in the per-token reward, so the policy loss carries none.
        self.loss_config = dataclasses.replace(self.loss_config, beta=0.0)
        self.train_step = make_train_step(
            self.mesh, loss_fn=policy_loss, model_config=self.model_config, loss_config=self.loss_config,
            optimizer=self.optimizer, grad_accum=g.grad_accum, params_sharding=self.params_sharding,
            opt_state_sharding=jax.tree.map(lambda x: x.sharding, self.opt_state),
        )
        if p.kl_coef_init > 0 and self.ref_params is None:
            self.ref_params = frozen_copy(self.params, self.model_config)
        elif p.kl_coef_init == 0:
            self.ref_params = None  # no KL term: skip the reference pass (kl is then reported as 0)

        if p.critic_init == "policy":
            self.critic_config: ModelConfig = self.model_config
            critic = critic_from_policy(self.params, self.model_config)
        else:
            self.critic_config, critic = load_critic(p.critic_init, mesh=self.mesh, dtype=c.model.dtype,
                                                     param_dtype=c.model.param_dtype, remat=c.model.remat,
                                                     attention_query_chunk=c.model.attention_query_chunk)
            critic = master_weights(critic)
            if self.critic_config.vocab_size < len(self.tokenizer):
                raise ConfigError(f"ppo.critic_init={p.critic_init}: vocabulary of {self.critic_config.vocab_size}"
                                    f" tokens, smaller than the policy's tokenizer ({len(self.tokenizer)})")
        critic_optim = dataclasses.replace(c.optim, learning_rate=p.critic_learning_rate)
        self.critic_optimizer, self.critic_schedule = make_optimizer(
            critic_optim, max(c.steps * self.updates_per_step, 1)
        )
        critic_sharding = param_shardings(critic, self.mesh)
        self.critic = jax.device_put(critic, critic_sharding)
        self.critic_opt_state = init_optimizer_state(self.critic_optimizer, self.critic, critic_sharding, self.mesh)
        self.critic_step = make_train_step(
            self.mesh,
            loss_fn=critic_loss,
            model_config=self.critic_config,
            loss_config=ValueLossConfig(  # type: ignore[arg-type]  # train_step passes it through to critic_loss
                clip_range=p.value_clip or None, aggregation=g.loss_aggregation, max_len=c.sampling.max_new_tokens
            ),
            optimizer=self.critic_optimizer,
            grad_accum=g.grad_accum,
            params_sharding=critic_sharding,
            opt_state_sharding=jax.tree.map(lambda x: x.sharding, self.critic_opt_state),
        )
        critic_config = self.critic_config

        def values_of(critic: CriticParams, pt: jax.Array, pm: jax.Array, ct: jax.Array, cm: jax.Array) -> jax.Array:
            return critic_values(critic, critic_config, pt, pm, ct, cm)

        self.value_fn = jax.jit(
            values_of,
            in_shardings=(critic_sharding, *[batch_sharding(self.mesh)] * 4),
            out_shardings=batch_sharding(self.mesh),
        )
        self.targets_fn = jax.jit(self._targets_and_metrics)
        self.kl_controller = init_kl_controller(p.kl_coef_init)
        if resume:
            self._restore()

    def _targets_and_metrics(self, scores: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, values: jax.Array,
                             mask: jax.Array, kl_coef: jax.Array) -> tuple[PPOTargets, Metrics]:
        p = self.config.ppo
        targets = ppo_targets(scores, old_logp, ref_logp, values, mask, kl_coef, gamma=p.gamma, lam=p.lam,
                              kl_estimator=p.kl_estimator, whiten_advantages=p.whiten_advantages)  # type: ignore[arg-type]
        return targets, rollout_value_metrics(targets, values, mask)

    # ------------------------------------------------------------------------------------------ checkpoints

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "critic": self.critic, "critic_opt_state": self.critic_opt_state,
                "kl_coef": global_array(np.asarray(self.kl_controller.coef), self.mesh, PartitionSpec())}

    def _restore(self) -> dict[str, Any]:
        state = super()._restore()
        self.critic, self.critic_opt_state = state["critic"], state["critic_opt_state"]
        self.kl_controller = KLControllerState(coef=jnp.asarray(state["kl_coef"], jnp.float32))
        return state

    # ------------------------------------------------------------------------------------------ the update

    def update(self, ro: Rollout, key: jax.Array) -> dict[str, float]:
        """Values, KL-shaped token rewards, GAE; then `mu` epochs of (policy, critic) minibatch updates."""
        g, p = self.config.grpo, self.config.ppo
        put = functools.partial(global_array, mesh=self.mesh)
        pt, pm, ct, cm = put(ro.prompt_tokens), put(ro.prompt_mask), put(ro.out.tokens), put(ro.out.mask)
        old_logp = put(np.asarray(ro.out.logprobs_untruncated, np.float32))
        ref_logp = self.ref_logprob_fn(self.ref_params, pt, pm, ct, cm) if self.ref_params is not None else old_logp
        values = self.value_fn(self.critic, pt, pm, ct, cm)
        kl_coef = float(self.kl_controller.coef)
        targets, rollout_metrics = self.targets_fn(put(ro.rewards.astype(np.float32)), old_logp, ref_logp, values, cm,
                                                   self.kl_controller.coef)
        to_np = to_host
        policy_full = PolicyBatch(ro.prompt_tokens, ro.prompt_mask, ro.out.tokens, ro.out.mask, to_np(old_logp),
                                  to_np(ref_logp), to_np(targets.advantages))
        critic_full = CriticBatch(ro.prompt_tokens, ro.prompt_mask, ro.out.tokens, ro.out.mask, to_np(values),
                                  to_np(targets.returns))
        train_policy = self.step > p.critic_warmup_steps
        history: list[dict[str, jax.Array]] = []
        for epoch in range(g.mu):
            order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), self.rollout_size))
            for start in range(0, self.rollout_size, self.minibatch_size):
                rows = order[start : start + self.minibatch_size]
                metrics: dict[str, jax.Array] = {}
                if train_policy:
                    batch = PolicyBatch(*[put(np.asarray(x)[rows]) for x in policy_full])
                    self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, batch)
                    metrics = dict(metrics)
                critic_batch = CriticBatch(*[put(np.asarray(x)[rows]) for x in critic_full])
                self.critic, self.critic_opt_state, critic_metrics = self.critic_step(
                    self.critic, self.critic_opt_state, critic_batch
                )
                metrics.update({
                    "value_loss": critic_metrics["value_loss"],
                    "value_clip_fraction": critic_metrics["value_clip_fraction"],
                    "critic/grad_norm": critic_metrics["grad_norm"],
                    "critic/update_skipped": critic_metrics["update_skipped"],
                })
                history.append(metrics)
        merged = _merge_update_metrics(jax.device_get(history), policy_updated=train_policy)
        merged.update({k: float(v) for k, v in jax.device_get(rollout_metrics).items()})
        mask = np.asarray(ro.out.mask, bool)
        advantages = to_np(targets.advantages)
        merged["advantages/abs_mean"] = float(np.abs(advantages)[mask].mean()) if mask.any() else 0.0
        merged["kl_coef"] = kl_coef
        merged["critic/learning_rate"] = float(self.critic_schedule(self.step * self.updates_per_step - 1))
        self.kl_controller = kl_controller_step(self.kl_controller, merged["kl"], self.rollout_size,
                                                target=p.kl_target, horizon=p.kl_horizon)
        return merged

    def _rollout_metrics(self, ro: Rollout, refills: int) -> dict[str, float]:
        out = super()._rollout_metrics(ro, refills)
        if self.config.grpo.group_size == 1:
            out.pop("frac_zero_std_groups")  # every "group" of one has zero std; the number means nothing here
        return out


def _merge_update_metrics(history: list[dict[str, Any]], *, policy_updated: bool) -> dict[str, float]:
    """Means over the minibatch updates of one step; min / max / sum for the extrema and skip counters."""
    merged = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
    if policy_updated:
        merged["ratio/min"] = float(np.min([h["ratio/min"] for h in history]))
        merged["ratio/max"] = float(np.max([h["ratio/max"] for h in history]))
        merged["update_skipped"] = float(np.sum([h["update_skipped"] for h in history]))
        merged["last_update_skipped"] = float(history[-1]["update_skipped"])
    else:  # critic warm-up: the policy is not updated (ratio 1, no drift); the skip guard watches the critic
        merged["approx_kl"] = 0.0
        merged["last_update_skipped"] = float(history[-1]["critic/update_skipped"])
    merged["critic/update_skipped"] = float(np.sum([h["critic/update_skipped"] for h in history]))
    return merged


def train_ppo(config: RunConfig, **run_dir_options: bool) -> dict[str, Any]:
    """Build the PPO trainer (`resume`, `overwrite`, `allow_config_change`: see `run_dir`) and run it."""
    return PPOTrainer(config, **run_dir_options).run()
