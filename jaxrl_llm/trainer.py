"""The GRPO loop: the thin shell that owns every side effect.

    prompts -> sample (jit) -> rewards (host) -> advantages (pure) -> [reference log-probs] -> mu passes of
    train_step (jit) over minibatches -> metrics, samples, evaluation, checkpoints

The sampler's log-probs (full distribution at the sampling temperature) are kept as the old policy's, so the
importance ratio and clipping are real when `mu > 1` or minibatches make several updates per rollout.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.checkpoint import Checkpointer
from jaxrl_llm.config import RunConfig, advantage_estimator
from jaxrl_llm.data import (
    DataState,
    PromptSet,
    bucket,
    build_prompt_set,
    eos_token_ids,
    left_pad,
    load_records,
    load_tokenizer,
    next_batch_indices,
)
from jaxrl_llm.divergence import DivergenceLimits, DivergenceState, update_divergence
from jaxrl_llm.errors import ConfigError, DivergenceError, TrainingError
from jaxrl_llm.evaluation import decode_completions, evaluate_greedy, reward_fields
from jaxrl_llm.logging import RunLogger, write_summary
from jaxrl_llm.models.hf import load_hf_model, resolve_model_dir, save_hf_model
from jaxrl_llm.rewards import RewardFunction, compute_rewards, resolve_reward
from jaxrl_llm.rl.estimators import kl_in_reward, rollout_advantages
from jaxrl_llm.run_dir import open_run_dir
from jaxrl_llm.sampling import SampleOutput, SamplingConfig, sample
from jaxrl_llm.sharding import (
    MeshShape,
    batch_divisor,
    global_array,
    init_optimizer_state,
    make_mesh,
    optimizer_state_shardings,
    process_rows,
    to_host,
)
from jaxrl_llm.train_step import (
    PolicyBatch,
    PolicyLossConfig,
    frozen_copy,
    make_logprob_fn,
    make_optimizer,
    make_train_step,
    master_weights,
    policy_loss,
)

MAX_CONSECUTIVE_SKIPPED_UPDATES = 5


@dataclasses.dataclass
class Rollout:
    prompt_tokens: np.ndarray  # [N, P]
    prompt_mask: np.ndarray
    out: SampleOutput
    rewards: np.ndarray  # [N]
    per_function: dict[str, np.ndarray]
    completions: list[str]
    record_indices: np.ndarray  # [N // G] prompt records


class GRPOTrainer:
    """Holds the run's state between steps; `run()` executes `config.steps` GRPO steps."""

    def __init__(self, config: RunConfig, *, resume: bool = False, overwrite: bool = False,
                 allow_config_change: bool = False, restore: bool = True) -> None:
        """`resume`: continue from the latest checkpoint in `out_dir` (`restore=False` leaves the restore to a
        subclass); `overwrite`: start over in an out_dir that holds a run; see `run_dir.open_run_dir`."""
        self.config = c = config
        self.out_dir = Path(c.out_dir)
        self.resumed = resume
        self.run_dir = open_run_dir(c, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                                    export_dir=self.export_dir if c.export else None,
                                    input_dirs=(c.model.path,))
        try:
            self._build(resume and restore)
        except BaseException:
            self.run_dir.release()
            raise

    @property
    def export_dir(self) -> Path:
        return Path(self.config.export_dir or Path(self.config.out_dir) / "hf")

    def _build(self, restore: bool) -> None:
        c = self.config
        self.model_dir = resolve_model_dir(c.model.path)
        self.mesh = make_mesh(MeshShape(c.mesh.data, c.mesh.fsdp, c.mesh.tensor))
        # Each device reads only its shards of the checkpoint.
        # Float32 master weights whatever model.param_dtype says; the train step computes with the working
        # copy in param_dtype (see train_step.master_weights).
        config, params = load_hf_model(
            self.model_dir, mesh=self.mesh, dtype=c.model.dtype, param_dtype=c.model.param_dtype,
            remat=c.model.remat, attention_query_chunk=c.model.attention_query_chunk,
        )
        self.model_config, self.params = config, master_weights(params)
        self.params_sharding = jax.tree.map(lambda x: x.sharding, self.params)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)

        self.train_set = self._prompt_set(c.data.train, c.data.split)
        self.eval_set = self._prompt_set(c.data.eval, c.data.eval_split) if c.data.eval else None
        self.reward_fns: list[tuple[str, RewardFunction, float]] = []
        for i, spec in enumerate(c.rewards):
            name = spec.name if all(s.name != spec.name for s in c.rewards[:i]) else f"{spec.name}_{i}"
            self.reward_fns.append((name, resolve_reward(spec.name, dict(spec.kwargs)), spec.weight, spec.timeout_s))

        self.eval_reward: tuple[str, RewardFunction] = (
            (c.eval_reward, resolve_reward(c.eval_reward)) if c.eval_reward else self.reward_fns[0][:2]
        )
        g = c.grpo
        n_dev = batch_divisor(self.mesh)
        self.rollout_size = g.prompts_per_step * g.group_size
        self.minibatch_size = g.minibatch_size or self.rollout_size
        if (self.minibatch_size // g.grad_accum) % n_dev:
            raise ConfigError(
                f"the micro-batch (grpo.minibatch_size / grpo.grad_accum = {self.minibatch_size} / {g.grad_accum})"
                f" must be divisible by mesh.data * mesh.fsdp ({n_dev}) for the data-parallel step"
            )
        self.updates_per_step = g.mu * (self.rollout_size // self.minibatch_size)
        self.optimizer, self.schedule = make_optimizer(c.optim, max(c.steps * self.updates_per_step, 1))
        self.estimator = advantage_estimator(c)
        self.loss_config = PolicyLossConfig(
            temperature=c.sampling.temperature,
            epsilon_low=g.epsilon_low,
            epsilon_high=g.epsilon_high,
            dual_clip_c=g.dual_clip_c or None,
            ratio_level=g.ratio_level,
            beta=0.0 if kl_in_reward(self.estimator) else g.beta,
            kl_estimator=g.kl_estimator,
            aggregation=g.loss_aggregation,
            entropy_coef=g.entropy_coef,
            max_len=c.sampling.max_new_tokens,
            logprob_block_mib=c.model.logprob_block_mib,
        )
        self.advantage_fn = jax.jit(functools.partial(
            rollout_advantages, self.estimator, group_size=g.group_size, scale=g.scale_rewards, beta=g.beta,
            kl_estimator=g.kl_estimator,
        ))
        self.train_step = make_train_step(
            self.mesh,
            loss_fn=policy_loss,
            model_config=self.model_config,
            loss_config=self.loss_config,
            optimizer=self.optimizer,
            grad_accum=g.grad_accum,
            params_sharding=self.params_sharding,
            opt_state_sharding=optimizer_state_shardings(
                self.optimizer, jax.eval_shape(self.optimizer.init, self.params), self.params_sharding, self.mesh
            ),
        )
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        # The reference policy is a frozen copy, only needed when the KL term is on.
        self.ref_params = frozen_copy(self.params, self.model_config) if g.beta > 0 else None
        self.ref_logprob_fn = make_logprob_fn(self.mesh, self.model_config, c.sampling.temperature,
                                              self.params_sharding, block_mib=c.model.logprob_block_mib)
        self.opt_state = init_optimizer_state(self.optimizer, self.params, self.params_sharding, self.mesh)
        self.root_key = jax.random.key(c.seed)
        self.step = 0
        self.data_state = DataState()
        self.checkpointer = Checkpointer(self.out_dir / "checkpoints", keep=c.keep_checkpoints)
        self.divergence = DivergenceState()
        self.reward_seconds: dict[str, float] = {}
        if restore:
            self._restore()

    # ------------------------------------------------------------------------------------------ set-up

    def _prompt_set(self, source: str, split: str) -> PromptSet:
        records, label = load_records(source, split)
        return build_prompt_set(records, label, self.config.data, self.tokenizer)

    def _state(self) -> dict[str, Any]:
        # Host-side values are saved as replicated global arrays (what orbax needs with several processes).
        key = global_array(np.asarray(jax.random.key_data(self.root_key)), self.mesh, PartitionSpec())
        return {"params": self.params, "opt_state": self.opt_state, "key": key}

    def _restore(self) -> dict[str, Any]:
        """Load the latest readable checkpoint into the run's state and return the restored pytree, so
        subclasses can take their own entries of `_state` from it. Raises `RunDirError` without one."""
        state, meta = self.checkpointer.restore_latest(self._state())
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.root_key = jax.random.wrap_key_data(state["key"])
        self.step = int(meta["step"])
        self.data_state = DataState(**meta["data_state"])
        self.divergence = DivergenceState.from_json(meta.get("divergence"))
        # ref_params stays the starting policy, which __init__ just loaded from the model directory.
        return state

    def save_checkpoint(self) -> None:
        meta = {"step": self.step, "data_state": dataclasses.asdict(self.data_state),
                "divergence": self.divergence.to_json()}
        self.checkpointer.save(self.step, self._state(), meta)

    # ------------------------------------------------------------------------------------------ pieces

    def sampling_config(self, *, greedy: bool = False, n: int = 1) -> SamplingConfig:
        s = self.config.sampling
        return SamplingConfig(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            min_p=s.min_p,
            greedy=greedy,
            n=n,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            prompt_bucket=s.prompt_bucket,
            new_tokens_bucket=s.new_tokens_bucket,
        )

    def _prompt_arrays(self, prompt_set: PromptSet, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seqs = [prompt_set.token_ids[i] for i in indices]
        return left_pad(seqs, bucket(max(len(s) for s in seqs), self.config.sampling.prompt_bucket), self.pad_id)

    def rollout(self, indices: np.ndarray, key: jax.Array) -> Rollout:
        """Sample G completions for each prompt and score them."""
        g = self.config.grpo.group_size
        tokens, mask = self._prompt_arrays(self.train_set, indices)
        out = to_host(sample(self.params, self.model_config, tokens, mask, key, self.sampling_config(n=g),
                             mesh=self.mesh))
        completions = decode_completions(self.tokenizer, out)
        records = [self.train_set.records[i] for i in indices for _ in range(g)]
        prompts = [self.train_set.texts[i] for i in indices for _ in range(g)]
        rewards, each = self._rewards(records, prompts, completions, out)
        return Rollout(np.repeat(tokens, g, axis=0), np.repeat(mask, g, axis=0), out, rewards, each,
                       completions, indices)

    def _rewards(self, records: list[dict[str, Any]], prompts: list[str], completions: list[str],
                 out: SampleOutput) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rewards of every row; with several processes each scores only its own share of the rows (whole
        groups), and the scores are then all-gathered."""
        mine = process_rows(len(prompts)) if jax.process_count() > 1 else slice(None)
        local = jax.tree.map(lambda x: np.asarray(x)[mine], out)
        rewards, each = compute_rewards(self.reward_fns, prompts[mine], completions[mine],
                                        reward_fields(records[mine], local, self.config.sampling.max_new_tokens),
                                        timings=self.reward_seconds)
        # float32 on every path: the cross-process all-gather carries float32, and the single-process run
        # must see the same numbers (e.g. dynamic sampling's std > 0 test).
        rewards, each = rewards.astype(np.float32), {k: v.astype(np.float32) for k, v in each.items()}
        if jax.process_count() == 1:
            return rewards, each
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather((rewards, each), tiled=True)
        return np.asarray(gathered[0]), {k: np.asarray(v) for k, v in gathered[1].items()}

    def collect(self, key: jax.Array) -> tuple[Rollout, int]:
        """One rollout of P prompts; with dynamic sampling (DAPO), groups whose rewards are all equal are
        replaced by freshly sampled ones (up to `max_refill_rounds` extra rounds)."""
        g = self.config.grpo
        indices, self.data_state = next_batch_indices(
            len(self.train_set), g.prompts_per_step, self.data_state, self.config.seed, self.config.data.shuffle
        )
        ro = self.rollout(indices, key)
        if not g.dynamic_sampling:
            return ro, 0
        keep = self._informative_groups(ro)
        parts, rounds = [(ro, keep)], 0
        while sum(int(k.sum()) for _, k in parts) < g.prompts_per_step and rounds < g.max_refill_rounds:
            rounds += 1
            indices, self.data_state = next_batch_indices(
                len(self.train_set), g.prompts_per_step, self.data_state, self.config.seed, self.config.data.shuffle
            )
            extra = self.rollout(indices, jax.random.fold_in(key, rounds))
            parts.append((extra, self._informative_groups(extra)))
        return self._assemble(parts), rounds

    def _informative_groups(self, ro: Rollout) -> np.ndarray:
        grouped = ro.rewards.reshape(-1, self.config.grpo.group_size)
        return grouped.std(axis=1) > 0

    def _assemble(self, parts: list[tuple[Rollout, np.ndarray]]) -> Rollout:
        """P groups: informative ones first, then (if refills ran out) zero-variance ones (zero advantage)."""
        g, p = self.config.grpo.group_size, self.config.grpo.prompts_per_step
        chosen = [(ro, i) for ro, keep in parts for i in np.flatnonzero(keep)]
        chosen += [(ro, i) for ro, keep in parts for i in np.flatnonzero(~keep)]
        chosen = chosen[:p]
        width = max(ro.prompt_tokens.shape[1] for ro, _ in chosen)

        def rows(ro: Rollout, i: int) -> slice:
            return slice(i * g, (i + 1) * g)

        def take(get: Any) -> np.ndarray:
            return np.concatenate([get(ro)[rows(ro, i)] for ro, i in chosen])

        def pad_prompt(x: np.ndarray, value: int) -> np.ndarray:
            return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)

        out = SampleOutput(*[take(lambda ro, f=f: np.asarray(getattr(ro.out, f))) for f in SampleOutput._fields])
        return Rollout(
            prompt_tokens=take(lambda ro: pad_prompt(ro.prompt_tokens, self.pad_id)),
            prompt_mask=take(lambda ro: pad_prompt(ro.prompt_mask, 0)),
            out=out,
            rewards=take(lambda ro: ro.rewards),
            per_function={k: take(lambda ro, k=k: ro.per_function[k]) for k in parts[0][0].per_function},
            completions=[ro.completions[j] for ro, i in chosen for j in range(i * g, (i + 1) * g)],
            record_indices=np.asarray([ro.record_indices[i] for ro, i in chosen]),
        )

    def evaluate(self, limit: int | None = None) -> dict[str, float]:
        if self.eval_set is None:
            return {}
        name, fn = self.eval_reward
        return evaluate_greedy(self.params, self.model_config, self.tokenizer, self.eval_set, (name, fn),
                               self.sampling_config(greedy=True), batch_size=self.config.eval_batch_size,
                               limit=limit, mesh=self.mesh)

    def update(self, ro: Rollout, key: jax.Array) -> dict[str, float]:
        """Advantages, reference log-probs and `mu` passes of minibatch updates over the rollout."""
        g = self.config.grpo
        put = functools.partial(global_array, mesh=self.mesh)
        pt, pm, ct, cm = put(ro.prompt_tokens), put(ro.prompt_mask), put(ro.out.tokens), put(ro.out.mask)
        if self.ref_params is not None:
            ref_logp = to_host(self.ref_logprob_fn(self.ref_params, pt, pm, ct, cm))
        else:
            ref_logp = np.zeros(ro.out.tokens.shape, np.float32)
        old_logp = np.asarray(ro.out.logprobs_untruncated)
        advantages = self.advantage_fn(jnp.asarray(ro.rewards), jnp.asarray(ro.out.mask), jnp.asarray(old_logp),
                                       jnp.asarray(ref_logp))
        full = PolicyBatch(
            np.asarray(ro.prompt_tokens), np.asarray(ro.prompt_mask), np.asarray(ro.out.tokens),
            np.asarray(ro.out.mask), old_logp, ref_logp, np.asarray(advantages),
        )
        history: list[dict[str, jax.Array]] = []
        for epoch in range(g.mu):
            order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), self.rollout_size))
            for start in range(0, self.rollout_size, self.minibatch_size):
                rows = order[start : start + self.minibatch_size]
                batch = PolicyBatch(*[put(x[rows]) for x in full])
                self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state, batch)
                history.append(metrics)
        history = jax.device_get(history)
        merged = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
        for k in ("ratio/min",):
            merged[k] = float(np.min([h[k] for h in history]))
        merged["ratio/max"] = float(np.max([h["ratio/max"] for h in history]))
        merged["update_skipped"] = float(np.sum([h["update_skipped"] for h in history]))
        merged["last_update_skipped"] = float(history[-1]["update_skipped"])
        mask = np.asarray(ro.out.mask, bool)
        merged["advantages/abs_mean"] = float(np.abs(full.advantages)[mask].mean()) if mask.any() else 0.0
        return merged

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            self.run_dir.release()

    def _run(self) -> dict[str, Any]:
        c = self.config
        logger = RunLogger(self.out_dir, total_steps=c.steps, initial_step=self.step,
                           tensorboard=c.tensorboard, progress_bar=c.progress_bar, desc=f"{c.algo}",
                           resume_step=self.step if self.resumed else None)
        logger.message(
            f"model {self.model_dir} ({self.model_config.num_params() / 1e6:.2f}M params), "
            f"{len(self.train_set)} train prompts ({self.train_set.num_dropped} dropped as too long), "
            f"{jax.device_count()} device(s)"
        )
        summary: dict[str, Any] = {}
        eval_limit = c.eval_size or None
        if self.step == 0 and self.eval_set is not None:
            summary["before"] = self.evaluate(eval_limit)
            logger.log(0, summary["before"])
            logger.message(f"held-out greedy accuracy before: {summary['before']['eval/accuracy']:.3f}")
        limits = DivergenceLimits(**dataclasses.asdict(c.divergence))
        diverged: dict[str, str] = {}
        flagged: dict[str, Any] = {}  # the latest divergence (on_divergence=warn runs on past it)
        skipped_in_a_row = 0
        try:
            while self.step < c.steps:
                self.step += 1
                key = jax.random.fold_in(self.root_key, self.step)
                sample_key, update_key = jax.random.split(key)
                self.reward_seconds = {}
                t0 = time.perf_counter()
                ro, refills = self.collect(sample_key)
                t1 = time.perf_counter()
                metrics = self.update(ro, update_key)
                t2 = time.perf_counter()
                skipped_in_a_row = skipped_in_a_row + 1 if metrics["last_update_skipped"] else 0
                metrics.update(self._rollout_metrics(ro, refills))
                n_tokens = float(np.asarray(ro.out.mask).sum())
                metrics.update({
                    "learning_rate": float(self.schedule(self.step * self.updates_per_step - 1)),
                    "time/rollout": t1 - t0,
                    "time/update": t2 - t1,
                    "time/step": t2 - t0,
                    "tokens_per_second": n_tokens / max(t1 - t0, 1e-9),
                    **{f"time/reward/{name}": s for name, s in self.reward_seconds.items()},
                })
                self.divergence, diverged = update_divergence(self.divergence, metrics,
                                                              vocab_size=self.model_config.vocab_size, limits=limits)
                last = self.step == c.steps or (diverged and c.on_divergence == "stop")
                if self.eval_set is not None and (last or (c.eval_every and self.step % c.eval_every == 0)):
                    metrics.update(self.evaluate(eval_limit))  # the final evaluation shares the last step's row
                    if last:
                        summary["after"] = {k: v for k, v in metrics.items() if k.startswith("eval/")}
                if self.step % c.log_every == 0 or last:
                    logger.log(self.step, metrics)
                if c.sample_every and self.step % c.sample_every == 0:
                    logger.samples(self.step, self._sample_rows(ro))
                kl = metrics.get("kl", metrics.get("approx_kl", 0.0))
                logger.progress({"reward": metrics["reward/mean"], "kl": kl,
                                 "s/step": metrics["time/step"]})
                if diverged:
                    flagged = {"step": self.step, "conditions": diverged}
                    logger.message(f"step {self.step}: the policy diverged: {'; '.join(diverged.values())}")
                    if c.on_divergence == "stop":
                        # Checkpoints written while the collapse built up are not good ones: set them aside,
                        # so the latest checkpoint (and a --resume) is the last good policy.
                        first_bad = self.step - max(self.divergence.streaks[n] for n in diverged) + 1
                        moved = self.checkpointer.set_aside(first_bad, "diverged_checkpoints")
                        if moved:
                            logger.message(f"checkpoints of steps {moved} moved to diverged_checkpoints/")
                        break
                if c.checkpoint_every and self.step % c.checkpoint_every == 0:
                    self.save_checkpoint()
                if skipped_in_a_row >= MAX_CONSECUTIVE_SKIPPED_UPDATES:
                    raise TrainingError(
                        f"step {self.step}: the last {skipped_in_a_row} steps had non-finite gradients and were "
                        f"skipped; stopping. Checkpoints in {self.checkpointer.directory} are intact "
                        f"(latest: {self.checkpointer.latest_step()})."
                    )
            stopped = bool(diverged) and c.on_divergence == "stop"
            if c.checkpoint_every and self.checkpointer.latest_step() != self.step and not stopped:
                self.save_checkpoint()
        finally:
            self.checkpointer.close()
            logger.close()
        if flagged:
            summary["diverged"] = {**flagged, "last_good_checkpoint": self.checkpointer.latest_step()}
        write_summary(self.out_dir, summary)
        if diverged and c.on_divergence == "stop":
            good = self.checkpointer.latest_step()
            kept = (f"Last good checkpoint: step {good} in {self.checkpointer.directory}" if good is not None else
                    f"No checkpoint was written before it (checkpoint_every={c.checkpoint_every})")
            raise DivergenceError(
                f"step {self.step}: the policy diverged ({'; '.join(diverged.values())}); stopped without export "
                f"(on_divergence=stop). {kept}; lower optim.learning_rate, or resume from a good checkpoint"
            )
        if c.export:
            params = to_host(self.params)  # gathered on every process; the first one writes
            if jax.process_index() == 0:
                summary["export"] = str(save_hf_model(params, self.model_config, self.export_dir,
                                                      dtype=self.model_config.param_dtype,
                                                      tokenizer_dir=self.model_dir))
                write_summary(self.out_dir, summary)
        return summary

    def _rollout_metrics(self, ro: Rollout, refills: int) -> dict[str, float]:
        g = self.config.grpo.group_size
        lengths = np.asarray(ro.out.lengths)
        grouped = ro.rewards.reshape(-1, g)
        out = {
            "reward/mean": float(ro.rewards.mean()),
            "reward/std": float(ro.rewards.std()),
            "completion_length/mean": float(lengths.mean()),
            "completion_length/max": float(lengths.max()),
            "frac_truncated": float(1.0 - np.asarray(ro.out.stopped_on_eos).mean()),
            "frac_zero_std_groups": float((grouped.std(axis=1) == 0).mean()),
        }
        for name, values in ro.per_function.items():
            out[f"reward/{name}/mean"] = float(values.mean())
        if self.config.grpo.dynamic_sampling:
            out["dynamic_sampling/refill_rounds"] = float(refills)
        return out

    def _sample_rows(self, ro: Rollout, limit: int = 16) -> list[dict[str, Any]]:
        g = self.config.grpo.group_size
        rows = []
        for j in range(min(limit, len(ro.completions))):
            record_index = int(ro.record_indices[j // g])
            rows.append({
                "prompt": self.train_set.texts[record_index],
                "completion": ro.completions[j],
                "reward": float(ro.rewards[j]),
                **{f"reward/{k}": float(v[j]) for k, v in ro.per_function.items()},
            })
        return rows


def train_grpo(config: RunConfig, **run_dir_options: bool) -> dict[str, Any]:
    """Build the trainer (`resume`, `overwrite`, `allow_config_change`: see `run_dir`) and run it."""
    return GRPOTrainer(config, **run_dir_options).run()

