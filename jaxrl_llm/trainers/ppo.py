"""PPO with a learned critic and GAE (`--algo ppo`): a sibling of the GRPO family on the loop shell.

One step, in the order the data flows (Ziegler et al. 2019; Ouyang et al. 2022; Schulman et al. 2017)::

    prompts -> sample (jit) -> scores (host)                                      [trainers/rollouts.py]
    V_t        = critic(x, y_<t)                                       [N, T]   values of the rollout (jit)
    r_t, A_t, R_t = rl.estimators.ppo_targets(scores, logp_old, logp_ref, V)      KL (k1) in the reward, GAE
    one jit: mu epochs x minibatches (lax.scan), each:
        policy:  clipped surrogate on A_t (+ entropy bonus), no KL in the loss          (train_step)
        critic:  0.5 * max((V - R)^2, (V_clip - R)^2),  V_clip = V_old + clip(V - V_old, +-value_clip)
    beta <- KL controller(beta, mean KL per token)                         fixed, or adaptive if kl_target > 0

The critic is a decoder of its own plus a scalar head (`models/heads.py`), initialised from the policy (a copy,
zero head) or from a model directory such as a reward model's, and trained by its own AdamW. Policy, critic,
both optimizer states and the KL coefficient are one state (`PPOState` + the controller), checkpointed
together, so `--resume` continues a PPO run exactly where it stopped. Loop knobs are in `rl`, PPO's in `ppo`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.heads import CriticParams, critic_from_policy, critic_values, load_critic
from jaxrl_llm.rl.estimators import ppo_targets, rollout_value_metrics
from jaxrl_llm.rl.kl_control import KLControllerKind, KLControllerState, init_kl_controller, kl_controller_update
from jaxrl_llm.rl.losses import clipped_value_loss
from jaxrl_llm.sharding import batch_sharding, global_array, init_optimizer_state, param_shardings, to_host
from jaxrl_llm.trainers.grpo import old_policy_logprobs, policy_loss_config, update_sizes
from jaxrl_llm.trainers.policy import GreedyEvaluation, load_policy
from jaxrl_llm.trainers.rollouts import DriftMeter, Rollout, RolloutCollector
from jaxrl_llm.trainers.step import (
    Metrics,
    PolicyBatch,
    frozen_copy,
    make_logprob_fn,
    make_optimizer,
    master_weights,
    policy_loss,
    scanned_updates,
    train_step,
    working_weights,
)


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


def critic_loss(critic: CriticParams, batch: CriticBatch, *, model_config: ModelConfig,
                loss_config: ValueLossConfig, num_tokens: jax.Array, num_seqs: jax.Array) -> tuple[jax.Array, Metrics]:
    """`clipped_value_loss(V, V_old, R)` of one (micro-)batch, normalised by the whole minibatch's counts
    (the `train_step` contract); metrics `value_loss`, `value_clip_fraction`."""
    values = critic_values(critic, model_config, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens,
                           batch.completion_mask)
    loss, metrics = clipped_value_loss(values, batch.old_values, batch.returns, batch.completion_mask,
                                       clip_range=loss_config.clip_range,
                                       aggregation=loss_config.aggregation,  # type: ignore[arg-type]
                                       max_len=loss_config.max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"value_loss": metrics["value_loss"], "value_clip_fraction": metrics["value_clip_fraction"]}


def kl_controller_kind(target: float) -> KLControllerKind:
    """`ppo.kl_target > 0` asks for the adaptive controller; 0 keeps `beta` fixed."""
    return "adaptive" if target > 0 else "fixed"


class PPOState(NamedTuple):
    """Everything the PPO update changes: the policy and the critic with their optimizer states."""

    params: Any
    opt_state: optax.OptState
    critic: CriticParams
    critic_opt_state: optax.OptState


class PPOBatch(NamedTuple):
    policy: PolicyBatch
    critic: CriticBatch


class PPO:
    """PPO with a critic, GAE and the KL to the reference in the per-token reward."""

    label: ClassVar[str] = "ppo"

    def __init__(self, config: RunConfig) -> None:
        self.config = c = config
        pc = c.ppo
        self.policy = p = load_policy(c)
        self.mesh, self.vocab_size = p.mesh, p.model_config.vocab_size
        self.collector = RolloutCollector(p)
        self.evaluation = GreedyEvaluation(p, c.eval_batch_size)
        self.rollout_size, self.minibatch_size, self.updates_per_step = update_sizes(c, p.mesh)
        total_updates = max(c.steps * self.updates_per_step, 1)
        self.optimizer, self.schedule = make_optimizer(c.optim, total_updates)
        self.critic_optimizer, self.critic_schedule = make_optimizer(
            dataclasses.replace(c.optim, learning_rate=pc.critic_learning_rate), total_updates)
        # KL to the reference lives in the per-token reward, so the policy loss carries none.
        self.loss_config = policy_loss_config(c, beta=0.0)
        # The reference: a frozen copy of the starting policy (LoRA: the base weights themselves).
        self.ref_params = (p.base if p.base is not None else frozen_copy(p.params, p.model_config)) \
            if pc.kl_coef_init > 0 else None
        self.ref_logprob_fn = make_logprob_fn(p.mesh, p.model_config, c.sampling.temperature, p.weights_sharding,
                                              block_mib=c.model.logprob_block_mib)
        self.drift = DriftMeter(p, self.ref_params, self.ref_logprob_fn, c.diagnostics.drift_rows)
        if pc.critic_init == "policy":
            self.critic_config: ModelConfig = p.model_config
            critic = critic_from_policy(master_weights(p.model_weights()), p.model_config)  # a full critic
        else:
            self.critic_config, critic = load_critic(pc.critic_init, mesh=p.mesh, dtype=c.model.dtype,
                                                     param_dtype=c.model.param_dtype, remat=c.model.remat,
                                                     scan_unroll=c.model.scan_unroll,
                                                     attention_query_chunk=c.model.attention_query_chunk)
            critic = master_weights(critic)
            if self.critic_config.vocab_size < len(p.tokenizer):
                raise ConfigError(f"ppo.critic_init={pc.critic_init}: vocabulary of {self.critic_config.vocab_size}"
                                  f" tokens, smaller than the policy's tokenizer ({len(p.tokenizer)})")
        critic_sharding = param_shardings(critic, p.mesh)
        critic = jax.device_put(critic, critic_sharding)
        self.state_ = PPOState(
            p.params, init_optimizer_state(self.optimizer, p.params, p.params_sharding, p.mesh),
            critic, init_optimizer_state(self.critic_optimizer, critic, critic_sharding, p.mesh))
        self.kl_controller = init_kl_controller(pc.kl_coef_init)
        rows = batch_sharding(p.mesh)
        critic_config = self.critic_config
        self.value_fn = jax.jit(lambda critic, *batch: critic_values(critic, critic_config, *batch),
                                in_shardings=(critic_sharding, *[rows] * 4), out_shardings=rows)
        self.targets_fn = jax.jit(functools.partial(self.targets_and_metrics, pc.gamma, pc.lam, pc.kl_estimator,
                                                    pc.whiten_advantages))
        self.update_fns = {train_policy: self._make_update_fn(train_policy) for train_policy in (True, False)}

    @staticmethod
    def targets_and_metrics(gamma: float, lam: float, kl_estimator: str, whiten: bool, scores: jax.Array,
                            old_logp: jax.Array, ref_logp: jax.Array, values: jax.Array, mask: jax.Array,
                            kl_coef: jax.Array) -> tuple[Any, Metrics]:
        targets = ppo_targets(scores, old_logp, ref_logp, values, mask, kl_coef, gamma=gamma, lam=lam,
                              kl_estimator=kl_estimator, whiten_advantages=whiten)  # type: ignore[arg-type]
        return targets, rollout_value_metrics(targets, values, mask)

    def _make_update_fn(self, train_policy: bool) -> Any:
        """`(PPOState, PPOBatch, key) -> (PPOState, metrics)`: mu epochs x minibatches of (policy, critic)
        updates as one jit; with `train_policy=False` (critic warm-up) only the critic moves."""
        c, p, rows = self.config, self.policy, batch_sharding(self.policy.mesh)
        policy_step = functools.partial(train_step, loss_fn=policy_loss, model_config=p.model_config,
                                        loss_config=self.loss_config, optimizer=self.optimizer,
                                        grad_accum=c.rl.grad_accum, compose=p.compose)
        value_loss_config = ValueLossConfig(clip_range=c.ppo.value_clip or None, aggregation=c.rl.loss_aggregation,
                                            max_len=c.sampling.max_new_tokens)
        critic_step = functools.partial(train_step, loss_fn=critic_loss, model_config=self.critic_config,
                                        loss_config=value_loss_config,  # type: ignore[arg-type]
                                        optimizer=self.critic_optimizer, grad_accum=c.rl.grad_accum)

        dropout = p.lora_dropout

        def update(state: PPOState, batch: PPOBatch, key: jax.Array, frozen: Any) -> tuple[PPOState, Metrics]:
            dropout_key = jax.random.fold_in(key, 1 << 20)  # apart from the shuffle's fold_in(key, epoch)

            def one(carry: tuple[PPOState, jax.Array], batch: PPOBatch) -> tuple[tuple[PPOState, Any], Metrics]:
                state, i = carry
                step_key = (jax.random.fold_in(dropout_key, i),) if dropout else ()  # LoRA dropout, per update
                state, metrics = one_update(state, batch, frozen, step_key)
                return (state, i + 1), metrics

            (state, _), metrics, _ = scanned_updates(one, (state, jnp.int32(0)), batch, key, epochs=c.rl.mu,
                                                     minibatch_size=self.minibatch_size,
                                                     constrain=lambda b: jax.lax.with_sharding_constraint(b, rows))
            return state, metrics

        def one_update(state: PPOState, batch: PPOBatch, frozen: Any, step_key: tuple) -> tuple[PPOState, Metrics]:
            params, opt_state, metrics = state.params, state.opt_state, {}
            if train_policy:
                params, opt_state, metrics = policy_step(params, opt_state, batch.policy, frozen, *step_key)
            critic, critic_opt_state, critic_metrics = critic_step(state.critic, state.critic_opt_state,
                                                                   batch.critic)
            metrics = {**metrics, "value_loss": critic_metrics["value_loss"],
                       "value_clip_fraction": critic_metrics["value_clip_fraction"],
                       "critic/grad_norm": critic_metrics["grad_norm"],
                       "critic/update_skipped": critic_metrics["update_skipped"]}
            return PPOState(params, opt_state, critic, critic_opt_state), metrics

        shardings = jax.tree.map(lambda x: x.sharding, self.state_)
        replicated = NamedSharding(p.mesh, PartitionSpec())
        return jax.jit(update, in_shardings=(shardings, rows, replicated, p.frozen_sharding),
                       out_shardings=(shardings, replicated),
                       donate_argnums=(0,))

    # ------------------------------------------------------------------------------------------ the shell's API

    @property
    def params(self) -> Any:
        return self.state_.params

    @property
    def critic(self) -> CriticParams:
        return self.state_.critic

    def describe(self) -> str:
        p = self.policy
        return (f"model {p.tokenizer_dir} ({p.model_config.num_params() / 1e6:.2f}M params) and a critic, "
                f"{self.collector.describe()}, {jax.device_count()} device(s)")

    def state(self) -> dict[str, Any]:
        kl_coef = global_array(np.asarray(self.kl_controller.coef), self.mesh, PartitionSpec())
        return {"params": self.state_.params, "opt_state": self.state_.opt_state, "critic": self.state_.critic,
                "critic_opt_state": self.state_.critic_opt_state, "kl_coef": kl_coef}

    def load_state(self, state: dict[str, Any]) -> None:
        self.state_ = PPOState(state["params"], state["opt_state"], state["critic"], state["critic_opt_state"])
        self.policy.params = self.state_.params
        self.kl_controller = KLControllerState(coef=jnp.asarray(state["kl_coef"], jnp.float32))

    def collect(self, data_state: DataState, key: jax.Array) -> tuple[Rollout, DataState, dict[str, float]]:
        ro, data_state, refills = self.collector.collect(self.policy.inference_weights(), data_state, key)
        return ro, data_state, self.collector.metrics(ro, refills)

    def update(self, ro: Rollout, step: int, key: jax.Array) -> dict[str, float]:
        """Values, KL-shaped token rewards, GAE; then `mu` epochs of (policy, critic) minibatch updates."""
        pc = self.config.ppo
        put = functools.partial(global_array, mesh=self.mesh)
        pt, pm, ct, cm = put(ro.prompt_tokens), put(ro.prompt_mask), put(ro.out.tokens), put(ro.out.mask)
        old_logp, sampler_logp, mismatch = old_policy_logprobs(
            self.config.rl.rollout_correction, put(np.asarray(ro.out.logprobs_untruncated, np.float32)), cm,
            lambda: self.ref_logprob_fn(working_weights(self.policy.model_weights(), self.policy.model_config),
                                        pt, pm, ct, cm))
        ref_logp = self.ref_logprob_fn(self.ref_params, pt, pm, ct, cm) if self.ref_params is not None else old_logp
        values = self.value_fn(self.state_.critic, pt, pm, ct, cm)
        kl_coef = float(self.kl_controller.coef)
        targets, rollout_metrics = self.targets_fn(put(ro.rewards.astype(np.float32)), old_logp, ref_logp, values,
                                                   cm, self.kl_controller.coef)
        batch = PPOBatch(PolicyBatch(pt, pm, ct, cm, old_logp, ref_logp, targets.advantages, sampler_logp),
                         CriticBatch(pt, pm, ct, cm, values, targets.returns))
        train_policy = step > pc.critic_warmup_steps
        self.state_, metrics = self.update_fns[train_policy](self.state_, batch, key, self.policy.frozen)
        self.policy.params = self.state_.params
        out = {k: float(v) for k, v in jax.device_get({**metrics, **rollout_metrics}).items()} | mismatch
        if not train_policy:  # critic warm-up: the policy is not updated (ratio 1, no drift)
            out["approx_kl"] = 0.0
            out["last_update_skipped"] = out["critic/last_update_skipped"]
        out.pop("critic/last_update_skipped")
        mask = np.asarray(ro.out.mask, bool)
        advantages = to_host(targets.advantages)
        out["advantages/abs_mean"] = float(np.abs(advantages)[mask].mean()) if mask.any() else 0.0
        out["kl_coef"] = kl_coef
        out["learning_rate"] = float(self.schedule(step * self.updates_per_step - 1))
        out["critic/learning_rate"] = float(self.critic_schedule(step * self.updates_per_step - 1))
        self.kl_controller = kl_controller_update(self.kl_controller, out["kl"], self.rollout_size,
                                                  kind=kl_controller_kind(pc.kl_target), target=pc.kl_target,
                                                  horizon=pc.kl_horizon)
        return out

    def evaluate(self, limit: int | None) -> dict[str, float]:
        return self.evaluation(self.policy.inference_weights(), limit)

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        kl = {"kl": metrics["kl"]} if "kl" in metrics else {}
        return {"reward": metrics["reward/mean"], **kl, "s/step": metrics["time/step"]}

    def sample_rows(self, ro: Rollout) -> list[dict[str, Any]]:
        return self.collector.sample_rows(ro)

    def export(self, directory: Path) -> str:
        return self.policy.export(directory)
