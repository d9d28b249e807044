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
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.heads import CriticParams, critic_from_policy, critic_values, load_critic
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.weights import master_weights
from jaxrl_llm.optim import make_optimizer, router_frozen
from jaxrl_llm.rl.estimators import ppo_targets, rollout_value_metrics
from jaxrl_llm.rl.kl_control import KLControllerKind, KLControllerState, init_kl_controller, kl_controller_update
from jaxrl_llm.rl.value_loss import clipped_value_loss
from jaxrl_llm.sharding import (
    batch_sharding,
    global_array,
    init_optimizer_state,
    param_shardings,
    to_host,
    train_state_shardings,
)
from jaxrl_llm.trainers.base import State, Updated, host_metrics
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss, policy_objective
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.rl import RolloutAlgorithm, rollout_epochs, update_plan, update_sizes, validate_rl
from jaxrl_llm.trainers.rollouts import Rollout
from jaxrl_llm.trainers.step import Metrics, jit_update, state_sharding, train_step


class CriticBatch(NamedTuple):
    """One minibatch for the critic: the rollout's `sequences` (`models.sequences.Sequences`), old_values (the
    rollout's `V_t`) and returns (`R_t`) `[N, T]` float32."""

    sequences: Sequences
    old_values: jax.Array
    returns: jax.Array
    layout: PackedLayout | None = None  # the policy minibatch's packed rows (rl.packing), else None


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
    values = critic_values(critic, model_config, batch.sequences, batch.layout)
    loss, metrics = clipped_value_loss(values, batch.old_values, batch.returns, batch.sequences.completion_mask,
                                       clip_range=loss_config.clip_range,
                                       aggregation=loss_config.aggregation,  # type: ignore[arg-type]
                                       max_len=loss_config.max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"value_loss": metrics["value_loss"], "value_clip_fraction": metrics["value_clip_fraction"]}


def kl_controller_kind(target: float) -> KLControllerKind:
    """`ppo.kl_target > 0` asks for the adaptive controller; 0 keeps `beta` fixed."""
    return "adaptive" if target > 0 else "fixed"


class PPOBatch(NamedTuple):
    policy: PolicyBatch
    critic: CriticBatch


def validate_ppo(c: RunConfig) -> None:
    """PPO's own relations: the `rl` section's (`grpo.validate_rl`), no adaptive entropy control, and the KL
    controller's settings."""
    validate_rl(c, critic=True)
    p = c.ppo
    if c.env.name:
        raise ConfigError(f"env.name={c.env.name} with algo=ppo: multi-turn rollouts train the GRPO family (grpo, "
                          f"rloo, reinforce_pp); PPO's critic values single replies")
    if c.rl.entropy_target:
        raise ConfigError(f"rl.entropy_target={c.rl.entropy_target} with algo=ppo: adaptive entropy control is "
                          f"wired into the GRPO family (grpo, rloo, reinforce_pp); set rl.entropy_target=0")
    if p.kl_target > 0 and (p.kl_horizon <= 0 or p.kl_coef_init <= 0):
        raise ConfigError("the adaptive KL controller (ppo.kl_target > 0) needs ppo.kl_horizon > 0 and "
                          "ppo.kl_coef_init > 0")


def initial_critic(c: RunConfig, policy: Policy) -> tuple[ModelConfig, CriticParams]:
    """The critic's architecture and float32 weights on the mesh: a copy of the policy's decoder with a zero
    head (`ppo.critic_init=policy`), or a model directory's (a reward model's, say)."""
    pc = c.ppo
    if pc.critic_init == "policy":
        config, critic = policy.model_config, critic_from_policy(
            master_weights(policy.model_weights(policy.initial_params)), policy.model_config)
    else:
        config, critic = load_critic(pc.critic_init, mesh=policy.mesh, dtype=c.model.dtype,
                                     param_dtype=c.model.param_dtype, remat=c.model.remat,
                                     scan_unroll=c.model.scan_unroll,
                                     attention_query_chunk=c.model.attention_query_chunk)
        critic = master_weights(critic)
        if config.vocab_size < len(policy.tokenizer):
            raise ConfigError(f"ppo.critic_init={pc.critic_init}: vocabulary of {config.vocab_size} tokens, "
                              f"smaller than the policy's tokenizer ({len(policy.tokenizer)})")
    return config, jax.device_put(critic, param_shardings(critic, policy.mesh))


def make_ppo_update(c: RunConfig, policy: Policy, critic_config: ModelConfig, optimizers: tuple[Any, Any],
                    objective: PolicyObjective, minibatch_size: int, *, train_policy: bool,
                    grad_accum: int | None = None) -> Any:
    """`update(state, PPOBatch, key, frozen, layouts) -> (state, metrics)` for `jit_update`: mu epochs x
    minibatches of (policy, critic) updates in one `lax.scan`; with `train_policy=False` (critic warm-up) only the
    critic moves. The state's `kl_coef` passes through (the controller moves it on the host). `layouts`: with
    `rl.packing`, each micro-batch's packed rows (`packing.update_layouts`), shared by the policy and the critic;
    `rows`, the host's token-balanced minibatch rows (`rl.max_tokens_per_microbatch`, with its `grad_accum`)."""
    grad_accum = grad_accum or c.rl.grad_accum
    policy_step = functools.partial(train_step, loss_fn=policy_loss, model_config=policy.model_config,
                                    loss_config=objective, optimizer=optimizers[0],
                                    grad_accum=grad_accum, compose=policy.compose)
    value_loss_config = ValueLossConfig(clip_range=c.ppo.value_clip or None, aggregation=c.rl.loss.aggregation,
                                        max_len=c.sampling.max_new_tokens)
    critic_step = functools.partial(train_step, loss_fn=critic_loss, model_config=critic_config,
                                    loss_config=value_loss_config,  # type: ignore[arg-type]
                                    optimizer=optimizers[1], grad_accum=grad_accum)

    def one_update(state: State, batch: PPOBatch, frozen: Any, step_key: tuple) -> tuple[State, Metrics]:
        params, opt_state, metrics = state["params"], state["opt_state"], {}
        if train_policy:
            params, opt_state, metrics = policy_step(params, opt_state, batch.policy, frozen, *step_key)
        critic, critic_opt_state, critic_metrics = critic_step(state["critic"], state["critic_opt_state"],
                                                               batch.critic)
        metrics = {**metrics, "value_loss": critic_metrics["value_loss"],
                   "value_clip_fraction": critic_metrics["value_clip_fraction"],
                   "critic/grad_norm": critic_metrics["grad_norm"],
                   "critic/update_skipped": critic_metrics["update_skipped"]}
        return {**state, "params": params, "opt_state": opt_state, "critic": critic,
                "critic_opt_state": critic_opt_state}, metrics

    def update(state: State, batch: PPOBatch, key: jax.Array, frozen: Any, layouts: PackedLayout | None = None,
               rows: jax.Array | None = None) -> tuple[State, Metrics]:
        return rollout_epochs(
            lambda s, minibatch, step_key: one_update(s, minibatch, frozen, step_key), state, batch, key,
            epochs=c.rl.mu, minibatch_size=minibatch_size, mesh=policy.mesh, dropout=policy.lora_dropout,
            layouts=layouts, rows=rows,
            attach=lambda b, layout: PPOBatch(b.policy._replace(layout=layout), b.critic._replace(layout=layout)))

    return update


class PPO(RolloutAlgorithm):
    """PPO with a critic, GAE and the KL to the reference in the per-token reward.

    State: `{"params", "opt_state", "critic", "critic_opt_state", "kl_coef"}`."""

    label: ClassVar[str] = "ppo"
    group_relative: ClassVar[bool] = False  # the critic makes advantages without reward variance
    no_overlap: ClassVar[str] = ("PPO's advantages are GAE over its critic's values at the rollout's own policy, and "
                                 "its adaptive KL coefficient steps per rollout: not supported off-policy; use the "
                                 "GRPO family")

    @classmethod
    def validate(cls, c: RunConfig) -> None:
        validate_ppo(c)

    @classmethod
    def model_sources(cls, config: RunConfig) -> dict[str, str]:
        init = config.ppo.critic_init
        return {} if init == "policy" else {"ppo.critic_init": init}

    @classmethod
    def keeps_reference(cls, config: RunConfig) -> bool:
        return config.ppo.kl_coef_init > 0  # the KL penalty in the reward, to the starting policy

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config, reference=self.keeps_reference(config))
        c, pc, p = config, config.ppo, self.policy
        self.rollout_size, self.minibatch_size, self.updates_per_step = update_sizes(c)
        total_updates = max(c.steps * self.updates_per_step, 1)
        self.optimizer, self.schedule = make_optimizer(c.optim, total_updates, router_frozen(c.model.freeze_router))
        self.critic_optimizer, self.critic_schedule = make_optimizer(
            dataclasses.replace(c.optim, learning_rate=pc.critic_learning_rate), total_updates)
        self.critic_config, self.initial_critic = initial_critic(c, p)
        critic_sharding = state_sharding(self.initial_critic)
        critic_config = self.critic_config
        self.value_fn = jax.jit(lambda critic, sequences: critic_values(critic, critic_config, sequences),
                                in_shardings=(critic_sharding, batch_sharding(p.mesh)),
                                out_shardings=batch_sharding(p.mesh))
        self.targets_fn = jax.jit(functools.partial(targets_and_metrics, pc.gamma, pc.lam, pc.kl_estimator,
                                                    pc.whiten_advantages))
        self.objective = policy_objective(c, beta=0.0)  # the KL to the reference is in the reward
        self.update_fns: dict[tuple[bool, int], Any] = {}  # by (policy trained, micro-batches per update)

    def update_fn_for(self, train_policy: bool, grad_accum: int) -> Any:
        """The jitted update (built once per kind): the policy trained or only the critic, `grad_accum`
        micro-batches per optimizer update."""
        if (train_policy, grad_accum) not in self.update_fns:
            c, p = self.config, self.policy
            replicated = NamedSharding(p.mesh, PartitionSpec())
            self.update_fns[train_policy, grad_accum] = jit_update(
                make_ppo_update(c, p, self.critic_config, (self.optimizer, self.critic_optimizer), self.objective,
                                self.minibatch_size, train_policy=train_policy, grad_accum=grad_accum),
                p.mesh, self.state_shardings(), frozen_sharding=p.frozen_sharding,
                extra_shardings=(replicated, replicated))
        return self.update_fns[train_policy, grad_accum]

    def state_shardings(self) -> dict[str, Any]:
        """The placement of `init()`'s state, from shapes alone."""
        p, critic = self.policy, self.initial_critic
        policy = train_state_shardings(self.optimizer, p.initial_params, p.params_sharding, p.mesh)
        critic_state = train_state_shardings(self.critic_optimizer, critic, state_sharding(critic), p.mesh)
        return {**policy, "critic": critic_state["params"], "critic_opt_state": critic_state["opt_state"],
                "kl_coef": NamedSharding(p.mesh, PartitionSpec())}

    def init(self) -> State:
        p, critic = self.policy, self.initial_critic
        return {"params": p.initial_params,
                "opt_state": init_optimizer_state(self.optimizer, p.initial_params, p.params_sharding, p.mesh),
                "critic": critic,
                "critic_opt_state": init_optimizer_state(self.critic_optimizer, critic, state_sharding(critic), p.mesh),
                "kl_coef": global_array(np.asarray(init_kl_controller(self.config.ppo.kl_coef_init).coef), p.mesh,
                                        PartitionSpec())}

    def describe(self) -> str:
        return super().describe().replace(" params), ", " params) and a critic, ", 1)

    def update(self, state: State, ro: Rollout, step: int, key: jax.Array) -> Updated:
        """Values, KL-shaped token rewards, GAE; then `mu` epochs of (policy, critic) minibatch updates."""
        pc, p = self.config.ppo, self.policy
        put = functools.partial(global_array, mesh=self.mesh)
        old = self.old_policy(state, ro)
        old_logp, cm = old.old_logp, old.sequences.completion_mask
        ref_logp = old.ref_logp if old.ref_logp is not None else old_logp
        values = self.value_fn(state["critic"], old.sequences)
        controller = KLControllerState(coef=jnp.asarray(jax.device_get(state["kl_coef"]), jnp.float32))
        targets, rollout_metrics = self.targets_fn(put(ro.rewards.astype(np.float32)), old_logp, ref_logp, values,
                                                   cm, controller.coef)
        batch = PPOBatch(PolicyBatch(old.sequences, old_logp, ref_logp, targets.advantages, old.sampler_logp,
                                     routing=old.records),
                         CriticBatch(old.sequences, values, targets.returns))
        train_policy = step > pc.critic_warmup_steps
        plan = update_plan(self.config, ro, key, self.minibatch_size, self.mesh,
                           self.policy.model_config.num_params())
        state, metrics = self.update_fn_for(train_policy, plan.grad_accum)(state, batch, key, p.frozen, plan.layouts,
                                                                          plan.rows)
        out, skipped = host_metrics({**metrics, **rollout_metrics})
        out |= old.mismatch
        out["update/padding_frac"] = plan.padding_frac
        out["update/micro_batches"] = float(plan.grad_accum)
        critic_skipped = bool(out.pop("critic/last_update_skipped"))
        if not train_policy:  # critic warm-up: the policy is not updated (ratio 1, no drift)
            out["approx_kl"], skipped = 0.0, critic_skipped
        mask = np.asarray(ro.out.mask, bool)
        out["advantages/abs_mean"] = float(np.abs(to_host(targets.advantages))[mask].mean()) if mask.any() else 0.0
        out["kl_coef"] = float(controller.coef)
        out["learning_rate"] = float(self.schedule(step * self.updates_per_step - 1))
        out["critic/learning_rate"] = float(self.critic_schedule(step * self.updates_per_step - 1))
        controller = kl_controller_update(controller, out["kl"], self.rollout_size, kind=kl_controller_kind(
            pc.kl_target), target=pc.kl_target, horizon=pc.kl_horizon)
        return Updated({**state, "kl_coef": put(np.asarray(controller.coef), spec=PartitionSpec())}, out, skipped)


def targets_and_metrics(gamma: float, lam: float, kl_estimator: str, whiten: bool, scores: jax.Array,
                        old_logp: jax.Array, ref_logp: jax.Array, values: jax.Array, mask: jax.Array,
                        kl_coef: jax.Array) -> tuple[Any, Metrics]:
    """GAE targets of a rollout (`rl.estimators.ppo_targets`) and the value metrics, for one jit."""
    targets = ppo_targets(scores, old_logp, ref_logp, values, mask, kl_coef, gamma=gamma, lam=lam,
                          kl_estimator=kl_estimator, whiten_advantages=whiten)  # type: ignore[arg-type]
    return targets, rollout_value_metrics(targets, values, mask)
