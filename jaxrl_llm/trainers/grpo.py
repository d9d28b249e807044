"""The GRPO family (`--algo grpo | rloo | reinforce_pp`, and Dr.GRPO / DAPO / GSPO by settings): one algorithm
of the loop shell, differing only in the advantage estimator and the policy loss picked from the registries.

    collect:  P prompts x G samples, scored (trainers/rollouts.py); the sampler's log-probs are the old policy's
    update:   [reference log-probs] -> advantages (rl.estimators) -> one jit: rl.mu epochs x minibatches of
              train_step (lax.scan, shuffle on the device)
    adapt:    with rl.entropy_target > 0, the entropy coefficient is an input of that jit, moved after each step
              from the entropy the step measured (rl.entropy_control, Skywork-OR1) and checkpointed with the weights

The sampler's log-probs (full distribution at the sampling temperature) are kept as the old policy's, so the
importance ratio and clipping are real when `mu > 1` or minibatches make several updates per rollout; with
`rl.loss.rollout_correction` the trainer recomputes them instead (and may weight the loss by `old / sampler`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxrl_llm.algorithms import ALGORITHMS
from jaxrl_llm.config import RunConfig
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.optim import make_optimizer, router_frozen
from jaxrl_llm.rl.advantages import turn_level_advantages
from jaxrl_llm.rl.entropy_control import (
    EntropyControllerState,
    adaptive_entropy_update,
    applied_entropy_coef,
    init_entropy_controller,
)
from jaxrl_llm.rl.estimators import ADVANTAGE_ESTIMATORS, kl_in_reward, rollout_advantages
from jaxrl_llm.rl.plugins import advantage_estimator
from jaxrl_llm.rl.reductions import masked_mean
from jaxrl_llm.sharding import global_array, init_optimizer_state, train_state_shardings
from jaxrl_llm.trainers.base import State, Updated, host_metrics
from jaxrl_llm.trainers.objectives import LossFn, PolicyBatch, policy_loss, policy_objective
from jaxrl_llm.trainers.policy import Policy
from jaxrl_llm.trainers.rl import RolloutAlgorithm, rollout_epochs, update_plan, update_sizes, validate_rl
from jaxrl_llm.trainers.rollouts import Rollout
from jaxrl_llm.trainers.step import Metrics, jit_update, train_step


def validate_grpo(c: RunConfig) -> None:
    """The GRPO family's relations: the `rl` section's (`validate_rl`), a group of at least 2 for group-relative
    advantages, and adaptive entropy control's bounds."""
    validate_rl(c, critic=False)
    g = c.rl
    if c.env.name and g.dynamic_sampling:
        raise ConfigError(f"rl.dynamic_sampling=true with env.name={c.env.name}: refilling groups is single-turn only "
                          f"(episodes of different lengths do not stack); set rl.dynamic_sampling=false")
    estimator = ADVANTAGE_ESTIMATORS[advantage_estimator(ALGORITHMS[c.algo].estimator, g.estimator)]
    if g.group_size < 2 and estimator.compares_group:
        raise ConfigError(f"rl.group_size={g.group_size}: a group-relative advantage needs at least 2 samples")
    if g.entropy_target:
        if g.entropy_coef_min > g.entropy_coef_max:
            raise ConfigError(f"rl.entropy_coef_min={g.entropy_coef_min} must be <= "
                              f"rl.entropy_coef_max={g.entropy_coef_max}")
        if not g.entropy_coef_min <= g.entropy_coef <= g.entropy_coef_max:
            raise ConfigError(f"rl.entropy_coef={g.entropy_coef} (adaptive entropy control's start) must lie in "
                              f"[rl.entropy_coef_min, rl.entropy_coef_max] = [{g.entropy_coef_min}, "
                              f"{g.entropy_coef_max}]")


def make_grpo_update(c: RunConfig, policy: Policy, optimizer: optax.GradientTransformation,
                     objective: Any, minibatch_size: int, grad_accum: int | None = None,
                     loss_fn: LossFn = policy_loss) -> Any:
    """`update(state, batch [N, ...], key, frozen, layouts, rows) -> (state, metrics)` for `jit_update`:
    `rl.mu` epochs x minibatches of `train_step` in one `lax.scan` (`frozen`: LoRA's base weights, or None;
    `layouts`: with `rl.packing`, every micro-batch's packed layout `[U, ...]` (`packing.update_layouts`), else None;
    `rows`: the updates' minibatch rows `[U, MB]` when the host ordered them into token-balanced micro-batches, else
    None). `grad_accum`: micro-batches per update (default `rl.grad_accum`; a token budget picks it per step).
    `loss_fn` and its `objective`: the policy loss, or another loss of a `PolicyBatch` (distillation's JSD).
    With adaptive entropy control (`state["entropy_controller"]`) the loss's coefficient is the controller's
    (`applied_entropy_coef`, logged as `entropy_coef`) and the controller steps on the update's mean entropy, on
    the device (`adaptive_entropy_update`)."""
    step = functools.partial(train_step, loss_fn=loss_fn, model_config=policy.model_config,
                             loss_config=objective, optimizer=optimizer, grad_accum=grad_accum or c.rl.grad_accum,
                             compose=policy.compose)

    def update(state: State, batch: PolicyBatch, key: jax.Array, frozen: Any, layouts: PackedLayout | None = None,
               rows: jax.Array | None = None) -> tuple[State, Metrics]:
        ctl = EntropyControllerState(**state["entropy_controller"]) if "entropy_controller" in state else None
        entropy_coef = None if ctl is None else applied_entropy_coef(ctl)
        loss_inputs = None if entropy_coef is None else {"entropy_coef": entropy_coef}

        def one(carry: tuple[Any, Any], minibatch: PolicyBatch, step_key: tuple) -> tuple[tuple[Any, Any], Metrics]:
            params, opt_state, metrics = step(*carry, minibatch, frozen, *step_key, loss_inputs=loss_inputs)
            return (params, opt_state), metrics

        (params, opt_state), metrics = rollout_epochs(
            one, (state["params"], state["opt_state"]), batch, key, epochs=c.rl.mu, minibatch_size=minibatch_size,
            mesh=policy.mesh, dropout=policy.lora_dropout, layouts=layouts, rows=rows,
            attach=lambda b, layout: b._replace(layout=layout))
        state = {**state, "params": params, "opt_state": opt_state}
        if ctl is not None:  # the coefficient this step's loss used (0 while above target), then the next one
            r = c.rl
            state["entropy_controller"] = adaptive_entropy_update(
                ctl, metrics["entropy"], target=r.entropy_target, delta=r.entropy_coef_delta,
                min_coef=r.entropy_coef_min, max_coef=r.entropy_coef_max)._asdict()
            metrics = {**metrics, "entropy_coef": entropy_coef}
        return state, metrics

    return update


class GRPOFamily(RolloutAlgorithm):
    """GRPO, Dr.GRPO, DAPO, GSPO, RLOO, REINFORCE++: group sampling, a registered estimator, a clipped loss.

    State: `{"params", "opt_state"}`, and `"entropy_controller"` (coef, active) under adaptive entropy control."""

    label: ClassVar[str] = "grpo"

    @classmethod
    def validate(cls, c: RunConfig) -> None:
        validate_grpo(c)

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config, reference=self.keeps_reference(config))  # the reference only for a KL term
        c, r = config, config.rl
        self.label = c.algo  # type: ignore[misc]
        self.rollout_size, self.minibatch_size, self.updates_per_step = update_sizes(c)
        self.optimizer, self.schedule = make_optimizer(c.optim, max(c.steps * self.updates_per_step, 1),
                                                       router_frozen(c.model.freeze_router))
        self.estimator = advantage_estimator(ALGORITHMS[c.algo].estimator, r.estimator)
        self.objective = policy_objective(c, beta=0.0 if kl_in_reward(self.estimator) else r.beta)
        self.advantage_fn = jax.jit(functools.partial(
            rollout_advantages, self.estimator, group_size=r.group_size, scale=r.scale_rewards, beta=r.beta,
            kl_estimator=r.loss.kl_estimator,
        ))
        # the mean |advantage| over the loss's tokens, reduced where the advantages are (one scalar fetched)
        self.abs_mean_fn = jax.jit(lambda advantages, mask: masked_mean(jnp.abs(advantages), mask))
        # Adaptive entropy control (rl.entropy_target > 0): the controller is part of the state and steps inside the
        # update, on the entropy it measured; off = the config's fixed coefficient.
        self.adaptive_entropy = r.entropy_target > 0
        self.update_fns: dict[int, Any] = {}  # by micro-batches per update (a token budget picks it per step)
        self.loss_fn: LossFn = policy_loss
        self.frozen_input = self.policy.frozen  # the update's frozen input: LoRA's base (and a teacher), or None
        self.frozen_sharding = self.policy.frozen_sharding
        self.update_fn = self.update_fn_for(r.grad_accum)

    def update_fn_for(self, grad_accum: int) -> Any:
        """The jitted update with `grad_accum` micro-batches per optimizer update (built once)."""
        if grad_accum not in self.update_fns:
            c, p = self.config, self.policy
            replicated = jax.sharding.NamedSharding(p.mesh, PartitionSpec())
            self.update_fns[grad_accum] = jit_update(
                make_grpo_update(c, p, self.optimizer, self.objective, self.minibatch_size, grad_accum,
                                 self.loss_fn), p.mesh,
                self.state_shardings(), frozen_sharding=self.frozen_sharding,
                extra_shardings=(replicated, replicated))
        return self.update_fns[grad_accum]

    def state_shardings(self) -> dict[str, Any]:
        """The placement of `init()`'s state, from shapes alone."""
        p = self.policy
        out = train_state_shardings(self.optimizer, p.initial_params, p.params_sharding, p.mesh)
        if self.adaptive_entropy:
            replicated = jax.sharding.NamedSharding(p.mesh, PartitionSpec())
            out["entropy_controller"] = {name: replicated for name in EntropyControllerState._fields}
        return out

    def init(self) -> State:
        p = self.policy
        state: State = {"params": p.initial_params,
                        "opt_state": init_optimizer_state(self.optimizer, p.initial_params, p.params_sharding, p.mesh)}
        if self.adaptive_entropy:  # only then: checkpoints of fixed-coefficient runs keep their shape
            state["entropy_controller"] = self._put_controller(init_entropy_controller(self.config.rl.entropy_coef))
        return state

    def _put_controller(self, ctl: EntropyControllerState) -> dict[str, jax.Array]:
        return {name: global_array(np.asarray(value), self.mesh, PartitionSpec())
                for name, value in ctl._asdict().items()}

    def token_advantages(self, ro: Rollout, sequences: Sequences, old_logp: jax.Array, ref_logp: jax.Array
                         ) -> tuple[jax.Array, dict[str, float]]:
        """`(advantages [N, T], metrics)` of a rollout on the mesh: the estimator's over the rewards (per turn
        when the environment rewards turns). `sequences`: the rollout's, on the mesh (`OldPolicy.sequences`)."""
        put = functools.partial(global_array, mesh=self.mesh)
        rewards = put(ro.rewards.astype(np.float32))
        advantages = self.advantage_fn(rewards, sequences.targets_mask(), old_logp, ref_logp)
        if ro.turn_credit is not None:  # an environment that rewards turns: each turn's return still to come
            r = self.config.rl
            scale = r.scale_rewards if self.estimator == "grpo" else "none"  # RLOO, REINFORCE++: their own scales
            advantages = turn_level_advantages(advantages, put(ro.turn_credit), rewards, group_size=r.group_size,
                                               scale=scale)
        return advantages, {}

    # ------------------------------------------------------------------------------------------ the shell's API

    def update(self, state: State, ro: Rollout, step: int, key: jax.Array) -> Updated:
        """Reference log-probs, advantages, then `mu` epochs of minibatch updates in one jit; the rollout goes
        to the devices once and stays there."""
        put = functools.partial(global_array, mesh=self.mesh)
        old = self.old_policy(state, ro)
        # log pi_ref of the rollout's tokens, zeros when no KL term needs them.
        ref_logp = old.ref_logp if old.ref_logp is not None else put(np.zeros(ro.out.tokens.shape, np.float32))
        advantages, extra = self.token_advantages(ro, old.sequences, old.old_logp, ref_logp)
        batch = PolicyBatch(old.sequences, old.old_logp, ref_logp, advantages, old.sampler_logp, routing=old.records)
        plan = update_plan(self.config, ro, key, self.minibatch_size, self.mesh,
                           self.policy.model_config.num_params())
        update_fn = self.update_fn if plan.grad_accum == self.config.rl.grad_accum else self.update_fn_for(
            plan.grad_accum)  # the attribute: what a test may wrap
        state, metrics = update_fn(state, batch, key, self.frozen_input, plan.layouts, plan.rows)
        out, skipped = host_metrics({**metrics, "advantages/abs_mean": self.abs_mean_fn(advantages,
                                                                                    old.sequences.targets_mask())})
        out |= old.mismatch | extra
        out["update/padding_frac"] = plan.padding_frac
        out["update/micro_batches"] = float(plan.grad_accum)
        out["learning_rate"] = float(self.schedule(step * self.updates_per_step - 1))
        return Updated(state, out, skipped)
