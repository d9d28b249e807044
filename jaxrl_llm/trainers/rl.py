"""What the RL algorithms that sample their batches share (the GRPO family, PPO): `RolloutAlgorithm`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState
from jaxrl_llm.envs.sandbox import describe_sandbox, use_sandbox
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.moe import NO_RECORD, router_disagreement
from jaxrl_llm.models.packing import (
    PackedLayout,
    batch_layout,
    packing_pays,
    token_budget_micro_batches,
    update_layouts,
)
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.weights import frozen_copy, working_weights
from jaxrl_llm.rl.estimators import needs_values
from jaxrl_llm.rl.plugins import resolve_estimator, resolve_policy_loss
from jaxrl_llm.rl.rollout_correction import ROLLOUT_CORRECTION_MODES, logprob_mismatch
from jaxrl_llm.rl.surrogates import NO_DUAL_CLIP, POLICY_LOSSES
from jaxrl_llm.sharding import batch_divisor, batch_sharding, global_array
from jaxrl_llm.trainers.base import Algorithm, Collected, State
from jaxrl_llm.trainers.evaluation import EpisodeEvaluation, GreedyEvaluation
from jaxrl_llm.trainers.objectives import make_logprob_fn
from jaxrl_llm.trainers.policy import export_policy, load_policy
from jaxrl_llm.trainers.rollouts import DriftMeter, Rollout, RolloutCollector, rollout_tokens
from jaxrl_llm.trainers.step import Metrics, minibatch_rows, scanned_updates
from jaxrl_llm.trainers.trajectories import TrajectoryCollector


class UpdatePlan(NamedTuple):
    """How a step's update lays out its sequences: the packed layouts of every micro-batch (`rl.packing`), placed
    on the mesh, or None for the padded layout; the share of the positions it computes that are padding; the
    micro-batches per update; and with packing the minibatch rows `[U, MB]` the layouts were planned for
    (reordered into token-balanced micro-batches under `rl.max_tokens_per_microbatch`), else None (the update
    draws its own)."""

    layouts: PackedLayout | None
    padding_frac: float
    grad_accum: int
    rows: jax.Array | None = None


def update_plan(c: RunConfig, ro: Rollout, key: jax.Array, minibatch_size: int, mesh: Mesh,
                num_params: int) -> UpdatePlan:
    """The update's layout for rollout `ro`: with `rl.packing`, every micro-batch of the `rl.mu` epochs x
    minibatches the update's `minibatch_rows(key, ...)` draws, packed (`packing.update_layouts`) when that saves
    rows and the micro-batch is large enough to gain (`packing.packing_pays` of the model's `num_params`), else
    padded; with `rl.max_tokens_per_microbatch`, those minibatches split by tokens and always packed
    (`packing.token_budget_micro_batches`)."""
    valid = ro.input_valid
    r = c.rl
    padded = UpdatePlan(None, 1.0 - float(valid.mean()), r.grad_accum)
    micro_rows = minibatch_size // r.grad_accum
    if not r.packing or not (r.max_tokens_per_microbatch or packing_pays(micro_rows * valid.shape[1], num_params,
                                                                         r.packing_min_gflops)):
        return padded
    rows = np.asarray(jax.device_get(minibatch_rows(key, len(valid), epochs=r.mu, minibatch_size=minibatch_size)))
    accum = r.grad_accum
    if r.max_tokens_per_microbatch:
        rows, accum = token_budget_micro_batches(valid.sum(axis=1), rows, r.max_tokens_per_microbatch,
                                                 batch_divisor(mesh))
    plan = update_layouts(valid, ro.prompt_mask.shape[1], rows, accum, multiple=batch_divisor(mesh))
    if not r.max_tokens_per_microbatch and plan.layouts.source.shape[1] // accum >= micro_rows:
        return padded  # first-fit found nothing to share a row: the padded program is the cheaper one
    # The rows go with their layouts: the update takes them rather than drawing its own.
    put = functools.partial(global_array, mesh=mesh, spec=PartitionSpec())
    return UpdatePlan(jax.tree.map(put, plan.layouts), plan.padding_frac_packed, accum, put(rows.astype(np.int32)))


def rollout_epochs(step: Callable[[Any, Any, tuple[jax.Array, ...]], tuple[Any, Metrics]], carry: Any, batch: Any,
                   key: jax.Array, *, epochs: int, minibatch_size: int, mesh: Mesh, dropout: bool,
                   layouts: PackedLayout | None, rows: jax.Array | None,
                   attach: Callable[[Any, Any], Any]) -> tuple[Any, Metrics]:
    """`epochs` x minibatches of `step(carry, minibatch, step_key) -> (carry, metrics)` over a rollout's `batch` in
    one `lax.scan` (`step.scanned_updates`, each minibatch kept in the batch sharding of `mesh`): the update of the
    GRPO family and PPO. `step_key` is the update's own LoRA-dropout key `(key,)` with `dropout`, else `()`.
    `layouts`, `rows`: the host's plan (`update_plan`), each micro-batch's packed layout reaching its minibatch
    through `attach(minibatch, layout)`. Returns the carry and the reduced metrics."""
    row_sharding = batch_sharding(mesh)
    dropout_key = jax.random.fold_in(key, 1 << 20)  # apart from the shuffle's fold_in(key, epoch)

    def one(counted: tuple[Any, jax.Array], minibatch: Any) -> tuple[tuple[Any, jax.Array], Metrics]:
        inner, i = counted
        step_key = (jax.random.fold_in(dropout_key, i),) if dropout else ()  # LoRA dropout, per update
        inner, metrics = step(inner, minibatch, step_key)
        return (inner, i + 1), metrics

    (carry, _), metrics, _ = scanned_updates(
        one, (carry, jnp.int32(0)), batch, key, epochs=epochs, minibatch_size=minibatch_size,
        constrain=lambda b: jax.lax.with_sharding_constraint(b, row_sharding), per_update=layouts, attach=attach,
        rows=rows)
    return carry, metrics


def logprob_pass_layout(c: RunConfig, ro: Rollout, mesh: Mesh, num_params: int) -> PackedLayout | None:
    """The packed layout of a rollout's whole-batch log-prob passes (the reference model's, the old policy's), placed
    on the mesh: with `rl.packing`, when the padded pass is large enough to gain (`packing.packing_pays`) and
    first-fit saves rows; else None (padded)."""
    valid = ro.input_valid
    r = c.rl
    if not r.packing or not packing_pays(valid.size, num_params, r.packing_min_gflops):
        return None
    layout, _, _ = batch_layout(valid, ro.prompt_mask.shape[1], multiple=batch_divisor(mesh))
    if layout.source.shape[0] >= len(valid):
        return None
    return jax.tree.map(functools.partial(global_array, mesh=mesh, spec=PartitionSpec()), layout)


def update_sizes(c: RunConfig) -> tuple[int, int, int]:
    """`(rollout size, minibatch size, optimizer updates per step)`."""
    r = c.rl
    rollout = r.prompts_per_step * r.group_size
    minibatch = r.minibatch_size or rollout
    return rollout, minibatch, r.mu * (rollout // minibatch)


def rl_micro_batch(c: RunConfig) -> tuple[str, int]:
    """The micro-batch of the GRPO family's and PPO's data-parallel step."""
    rollout, minibatch, _ = update_sizes(c)
    return f"the micro-batch rl.minibatch_size / rl.grad_accum = {minibatch // c.rl.grad_accum} sequences", \
        minibatch // c.rl.grad_accum


# The keywords every surrogate takes (jaxrl_llm.rl.surrogates); rl.policy_loss_kwargs holds the others.
SURROGATE_PARAMETERS = ("logp", "old_logp", "advantages", "mask", "epsilon_low", "epsilon_high", "dual_clip_c")


def check_surrogate_settings(name: str, settings: dict[str, Any]) -> None:
    """`rl.policy_loss_kwargs` against the surrogate's signature: each key one of its own keywords (not one `rl.loss`
    sets), each value a number, string or boolean (the jitted update keeps them as static values)."""
    params = inspect.signature(POLICY_LOSSES[name]).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    own = [k for k in params if k not in SURROGATE_PARAMETERS and params[k].kind is not inspect.Parameter.VAR_KEYWORD]
    for key, value in settings.items():
        if key in SURROGATE_PARAMETERS or not (takes_any or key in own):
            raise ConfigError(f"rl.policy_loss_kwargs.{key}: rl.policy_loss={name} takes "
                              f"{', '.join(own) or 'no settings of its own'}"
                              + (" (the clip range is rl.loss's)" if key in SURROGATE_PARAMETERS else ""))
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"rl.policy_loss_kwargs.{key}={value!r}: a setting is a number, a string or a boolean")


def validate_rl(c: RunConfig, *, critic: bool) -> None:
    """The `rl` section's relations shared by the GRPO family and PPO (`critic`: the algorithm has a critic whose
    values the estimator reads): the sizes that must divide each other, the loss's options, and the names of the
    estimator and the policy loss (a `module:function` is imported here) with its settings."""
    g, o = c.rl, c.rl.loss
    resolve_policy_loss(g.policy_loss)
    check_surrogate_settings(g.policy_loss, g.policy_loss_kwargs)
    if g.estimator and needs_values(resolve_estimator(g.estimator)) != critic:
        raise ConfigError(f"rl.estimator={g.estimator} with algo={c.algo}: PPO's advantages are GAE over its "
                          f"critic's values (rl.estimator=gae or empty), and only --algo ppo has a critic")
    rollout, minibatch, _ = update_sizes(c)
    if rollout % minibatch:
        raise ConfigError(f"rl.minibatch_size={minibatch} must divide the rollout size rl.prompts_per_step * "
                          f"rl.group_size = {g.prompts_per_step} * {g.group_size} = {rollout}")
    if minibatch % g.grad_accum:
        raise ConfigError(f"rl.grad_accum={g.grad_accum} must divide rl.minibatch_size={minibatch}")
    if g.max_tokens_per_microbatch and not g.packing:
        raise ConfigError(f"rl.max_tokens_per_microbatch={g.max_tokens_per_microbatch} splits packed micro-batches "
                          f"by tokens; set rl.packing=true")
    if o.dual_clip_c and o.dual_clip_c <= 1:
        raise ConfigError(f"rl.loss.dual_clip_c={o.dual_clip_c} must be > 1 (or 0 to disable)")
    if o.dual_clip_c and g.policy_loss in NO_DUAL_CLIP:
        raise ConfigError(f"rl.loss.dual_clip_c={o.dual_clip_c} with rl.policy_loss={g.policy_loss}: it has no dual "
                          f"clip (set rl.loss.dual_clip_c=0)")
    if o.clip_cov_ratio and o.clip_cov_lb >= o.clip_cov_ub:
        raise ConfigError(f"rl.loss.clip_cov_lb={o.clip_cov_lb} must be < rl.loss.clip_cov_ub={o.clip_cov_ub}")


def old_policy_logprobs(rollout_correction: str, sampler_logp: jax.Array, mask: jax.Array,
                        recompute: Callable[[], jax.Array]) -> tuple[jax.Array, jax.Array | None, dict[str, float]]:
    """`(old_logp, sampler_logp for the loss or None, mismatch metrics)` of a rollout under
    `rl.loss.rollout_correction`: the sampler's log-probs as they are (`none`), or the trainer's `recompute()` with
    the mismatch measured (`logprob_mismatch`) and, for the importance-weighting modes, the sampler's kept for the
    loss's weights."""
    if rollout_correction == "none":
        return sampler_logp, None, {}
    old_logp = recompute()
    mismatch = {k: float(v) for k, v in jax.device_get(logprob_mismatch(old_logp, sampler_logp, mask)).items()}
    return old_logp, (sampler_logp if rollout_correction in ROLLOUT_CORRECTION_MODES else None), mismatch


def routed_pass(c: RunConfig, policy: Any) -> Callable[..., tuple[jax.Array, jax.Array]] | None:
    """An MoE policy's whole-batch pass with routing (`objectives.make_logprob_fn` with `records`), None for a dense one
    (whose `rl.routing_replay` must be `none`)."""
    mode = c.rl.routing_replay
    if not policy.model_config.is_moe:
        if mode != "none":
            raise ConfigError(f"rl.routing_replay={mode} replays a mixture of experts' routing, and "
                              f"{c.model.path} is a dense model: set rl.routing_replay=none")
        return None
    return make_logprob_fn(policy.mesh, policy.model_config, c.sampling.temperature, policy.weights_sharding,
                           block_mib=c.model.logprob_block_mib, records=True)


def moe_old_policy(c: RunConfig, routed_fn: Callable[..., tuple[jax.Array, jax.Array]], weights: Any,
                   sequences: Sequences, layout: PackedLayout | None, sampler_logp: jax.Array, ro: Rollout,
                   put: Callable[[np.ndarray], jax.Array]
                   ) -> tuple[jax.Array, jax.Array | None, dict[str, float], jax.Array | None]:
    """An MoE rollout's old policy: `(old_logp, sampler_logp for the loss or None, metrics, routing records)`.

    The trainer's pass runs whatever `rl.loss.rollout_correction` says (replaying the sampler's routing under
    `rl.routing_replay=rollout`), so `mismatch/*` (the log-prob mismatch, `logprob_mismatch`) is logged for every
    MoE run, with `mismatch/live_router_vs_rollout` (and per layer): the share of the sampler's recorded tokens whose
    experts the trainer's own router ranks otherwise, before any replay; and `mismatch/update_routing_vs_rollout`: the
    same share for the routing the update runs (0 under `rollout`, which replays the sampler's). The records the
    update gets: the sampler's (`rollout`, and `none`, where they are only compared), or this pass's own (`old`: R2)."""
    mode, correction = c.rl.routing_replay, c.rl.loss.rollout_correction
    sampled_records = None if ro.out.routing is None else put(np.asarray(ro.out.routing, np.int16))
    logp, live = routed_fn(weights, sequences, layout, sampled_records if mode == "rollout" else None)
    metrics = {k: float(v) for k, v in jax.device_get(
        logprob_mismatch(logp, sampler_logp, sequences.targets_mask())).items()}
    if sampled_records is not None:
        metrics |= router_mismatch(sampled_records, live)
        metrics["mismatch/update_routing_vs_rollout"] = (0.0 if mode == "rollout"
                                                         else metrics["mismatch/live_router_vs_rollout"])
    old_logp = sampler_logp if correction == "none" else logp
    weighted = sampler_logp if correction in ROLLOUT_CORRECTION_MODES else None
    return old_logp, weighted, metrics, live if mode == "old" else sampled_records


def router_mismatch(sampled: jax.Array, live: jax.Array) -> dict[str, float]:
    """`mismatch/live_router_vs_rollout` (mean over layers) and `.../layer_XX`: per MoE layer, the share of the tokens
    the sampler recorded whose top-k set the trainer's own router (`live`, `[N, P + T, L, k]`) ranks otherwise."""
    recorded = (sampled[..., 0, 0] != NO_RECORD).reshape(-1)
    flat = [jnp.moveaxis(x, 2, 0).reshape(x.shape[2], -1, x.shape[3]) for x in (sampled, live)]
    per_layer = np.asarray(jax.device_get(router_disagreement(flat[0], flat[1], recorded)))
    out = {"mismatch/live_router_vs_rollout": float(per_layer.mean())}
    return out | {f"mismatch/live_router_vs_rollout/layer_{i:02d}": float(v) for i, v in enumerate(per_layer)}


class OldPolicy(NamedTuple):
    """Where a rollout's update starts, on the mesh (`RolloutAlgorithm.old_policy`): the rollout's `sequences`
    (`Rollout.sequences`, with a multi-turn rollout's loss mask on the model's tokens), the old policy's log-probs,
    the sampler's kept for the loss's importance weights (else None), the reference's (None without a reference
    model), the mismatch metrics, and an MoE model's routing records."""

    sequences: Sequences
    old_logp: jax.Array
    sampler_logp: jax.Array | None
    ref_logp: jax.Array | None
    mismatch: dict[str, float]
    records: jax.Array | None


CODE_TESTS = ("code_tests", "jaxrl_llm.rewards.code_execution:code_tests_reward")


def sandbox_users(c: RunConfig) -> list[str]:
    """What in the run executes model code in the sandbox (`env.sandbox`): the python tool, the code_tests reward."""
    users = ["the python tool (env.tools)"] if c.env.name and "python" in c.env.tools else []
    rewards = [spec.name for spec in c.rewards] + [c.eval_reward]
    return users + [f"the {name} reward" for name in dict.fromkeys(rewards) if name in CODE_TESTS]


class RolloutAlgorithm(Algorithm):
    """What the algorithms that sample their batches share (the GRPO family, PPO): the policy, the rollout
    collector, the held-out evaluation and the drift meter, and the shell's calls that only read them. `reference`:
    keep the starting policy as the reference (a frozen copy; under LoRA the base itself)."""

    no_overlap: ClassVar[str] = ""  # the GRPO family and distillation sample beside training (docs/overlap.md)

    @classmethod
    def micro_batch(cls, c: RunConfig) -> tuple[str, int]:
        return rl_micro_batch(c)

    def __init__(self, config: RunConfig, *, reference: bool) -> None:
        super().__init__(config)
        c = config
        use_sandbox(c.env.sandbox)  # where the python tool and the code_tests reward run model code
        self.policy = p = load_policy(c)
        self.mesh, self.vocab_size = p.mesh, p.model_config.vocab_size
        # Multi-turn episodes with an environment (env.name), else one completion per prompt.
        self.collector = TrajectoryCollector(p) if c.env.name else RolloutCollector(p)
        self.evaluation = (EpisodeEvaluation(self.collector, c.eval_batch_size) if c.env.name
                           else GreedyEvaluation(p, c.eval_batch_size))
        self.ref_params = (p.base if p.base is not None else frozen_copy(p.initial_params, p.model_config)) \
            if reference else None
        self.ref_logprob_fn = make_logprob_fn(p.mesh, p.model_config, c.sampling.temperature, p.weights_sharding,
                                              block_mib=c.model.logprob_block_mib)
        self.drift_meter = DriftMeter(p, self.ref_params, self.ref_logprob_fn, c.monitor.drift_rows)
        self.routed_logprob_fn = routed_pass(c, p)  # an MoE policy's pass with routing; None for a dense one

    def old_policy(self, state: State, ro: Rollout) -> OldPolicy:
        """A rollout on the mesh (it goes to the devices once and stays there) with the log-probs its update needs:
        the old policy's (the sampler's, or recomputed under `rl.loss.rollout_correction`; an MoE model's pass with
        its routing, `moe_old_policy`) and the reference's. Both whole-batch passes share one packed layout."""
        c, p = self.config, self.policy
        put = functools.partial(global_array, mesh=self.mesh)
        sequences = jax.tree.map(put, ro.sequences())
        # Multi-turn: the loss, the advantages and the mismatch cover the model's tokens; attention covers all.
        loss_mask = sequences.targets_mask()
        # made only if a pass runs
        packed = functools.cache(lambda: logprob_pass_layout(c, ro, self.mesh, p.model_config.num_params()))
        weights = functools.cache(lambda: working_weights(p.model_weights(state["params"]), p.model_config))
        sampled, records = put(np.asarray(ro.out.logprobs_untruncated, np.float32)), None
        if self.routed_logprob_fn is not None:  # MoE: routing records, replay, the router's mismatch
            old_logp, sampler_logp, mismatch, records = moe_old_policy(
                c, self.routed_logprob_fn, weights(), sequences, packed(), sampled, ro, put)
        else:
            old_logp, sampler_logp, mismatch = old_policy_logprobs(
                c.rl.loss.rollout_correction, sampled, loss_mask,
                lambda: self.ref_logprob_fn(weights(), sequences, packed()))
        ref_logp = self.ref_logprob_fn(self.ref_params, sequences, packed()) if self.ref_params is not None else None
        return OldPolicy(sequences, old_logp, sampler_logp, ref_logp, mismatch, records)

    def describe(self) -> str:
        p = self.policy
        users = sandbox_users(self.config)
        sandbox = f"; {' and '.join(users)}: {describe_sandbox()}" if users else ""
        return (f"model {p.tokenizer_dir} ({p.model_config.num_params() / 1e6:.2f}M params), "
                f"{self.collector.describe()}, {jax.device_count()} device(s); "
                f"sampler: {p.describe_sampler()}"
                f"{sandbox}")

    def collect(self, state: State, data_state: DataState, key: jax.Array) -> Collected:
        return self.collect_with(self.policy.inference_weights(state["params"]), data_state, key)

    def sampler_weights(self, state: State) -> Any:
        return self.policy.sampler_weights(state["params"])

    def collect_with(self, weights: Any, data_state: DataState, key: jax.Array) -> Collected:
        ro, data_state, refills = self.collector.collect(weights, data_state, key)
        return Collected(ro, data_state, self.collector.metrics(ro, refills), rollout_tokens(ro))

    def sample_with(self, weights: Any, data_state: DataState, key: jax.Array
                    ) -> tuple[DataState, Callable[[], Collected]]:
        if not self.collector.samples_in_stages:
            return super().sample_with(weights, data_state, key)  # refills need the rewards to sample
        after, finish = self.collector.collect_in_stages(weights, data_state, key)

        def collected() -> Collected:
            ro, metrics = finish()
            return Collected(ro, after, metrics, rollout_tokens(ro))

        return after, collected

    def evaluate(self, state: State, limit: int | None) -> dict[str, float]:
        return self.evaluation(self.policy.inference_weights(state["params"]), limit)

    def drift(self, state: State, ro: Rollout) -> dict[str, float]:
        return self.drift_meter(state["params"], ro)

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        # `kl` only with a reference: approx_kl, the on-policy ratio's, is ~0 and would read as a bug.
        kl = {"kl": metrics["kl"]} if "kl" in metrics else {}
        return {"reward": metrics["reward/mean"], **kl, "s/step": metrics["time/step"]}

    def sample_rows(self, ro: Rollout) -> list[dict[str, Any]]:
        return self.collector.sample_rows(ro)

    def export(self, state: State, directory: Path) -> str:
        return export_policy(self.policy, state["params"], directory)
