"""The loop shell: the one place a run's side effects live, whatever the algorithm.

    open out_dir (lock, refuse/overwrite, resume checks) -> build the algorithm -> state = init() or the checkpoint
    -> evaluate before -> for each step:
         collect -> update -> monitor -> record (evaluation, drift, logs, samples) -> checkpoint
    (rollout.max_staleness > 0: a thread samples ahead and `collect` is taking its rollout; trainers/overlap.py)
    -> summary, export
    (Ctrl-C / SIGTERM: the step in flight finishes, is checkpointed, and `RunInterrupted` ends the run.)

The algorithm (`trainers/base.Algorithm`) is built once and never touches files; the state pytree it works on is
the shell's: passed to `collect` and `update`, replaced by what `update` returns, checkpointed with the run's key.
The health checks are one table (`run/monitor.py`): warnings are logged with a hint, a divergence ends the run
under `monitor.on_divergence=stop`, and updates skipped `monitor.max_skipped_updates` times in a row stop it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState
from jaxrl_llm.errors import DivergenceError, RunInterrupted, StorageError, TrainingError
from jaxrl_llm.run.checkpoint import Checkpointer, storage_cause
from jaxrl_llm.run.logging import RunLogger, write_summary
from jaxrl_llm.run.monitor import DivergenceState, Monitor
from jaxrl_llm.run.run_dir import open_run_dir
from jaxrl_llm.sharding import global_array
from jaxrl_llm.trainers.base import Algorithm, State
from jaxrl_llm.trainers.overlap import RolloutPipeline, Sampled, decode_sampled, encode_sampled, host_key

# The plain log line (not on a terminal): these metrics, when the step has them, after the algorithm's own.
PLAIN_LINE_FIELDS = (("reward/mean", "reward"), ("kl", "kl"), ("drift_kl", "drift"), ("entropy", "entropy"),
                     ("frac_zero_std_groups", "zero_std_groups"), ("frac_truncated", "truncated"))


class Trainer:
    """One run of `algorithm_cls` in `config.out_dir`; `run()` executes the steps up to `config.steps`.

    `resume`: continue from the latest readable checkpoint; `overwrite`: start over in an out_dir that holds a
    run; `allow_config_change`: resume with math-changing settings (see `run_dir.open_run_dir`)."""

    def __init__(self, config: RunConfig, algorithm_cls: type[Algorithm], *, resume: bool = False,
                 overwrite: bool = False, allow_config_change: bool = False, config_dir: str | Path | None = None,
                 allow_tracked_dir: bool = False) -> None:
        self.config = c = config
        self.out_dir, self.resumed = Path(c.out_dir), resume
        inputs = () if algorithm_cls.from_scratch and c.model.init else (c.model.path,)  # what outputs must spare
        self.run_dir = open_run_dir(c, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                                    export_dir=self.export_dir if c.export else None, input_dirs=inputs,
                                    config_dir=config_dir, allow_tracked_dir=allow_tracked_dir)
        try:
            if not inputs:  # a from-scratch model saves its tokenizer in the run
                self.run_dir.claim(self.out_dir / "tokenizer")
            self.algorithm = algorithm_cls(c)
            self.state, self.key, self.step, self.data_state = self.algorithm.init(), jax.random.key(c.seed), 0, \
                DataState()
            self.monitor = Monitor(c.monitor, self.algorithm.vocab_size)
            self.last_drift: float | None = None
            # rollout.max_staleness > 0: the sampling thread (started by `run`); rollouts a checkpoint held
            self.pipeline: RolloutPipeline | None = None
            self.in_flight: list[Sampled] = []
            self.checkpointer = Checkpointer(self.out_dir / "checkpoints", keep=c.keep_checkpoints,
                                             claim=self.run_dir.claim)
            if resume:
                restore(self)
        except BaseException:
            self.run_dir.release()
            raise

    @property
    def export_dir(self) -> Path:
        return Path(self.config.export_dir or Path(self.config.out_dir) / "hf")

    # ------------------------------------------------------------------------------------------ the loop

    def step_keys(self, step: int) -> tuple[jax.Array, jax.Array]:
        """`(collect key, update key)` of `step`."""
        collect_key, update_key = jax.random.split(jax.random.fold_in(self.key, step))
        return collect_key, update_key

    def run_step(self) -> tuple[Any, dict[str, float], bool]:
        """Collect (or take what the sampler made) and update once (`self.step` already advanced): the batch, the
        metrics, whether skipped."""
        algo = self.algorithm
        collect_key, update_key = self.step_keys(self.step)
        t0 = time.perf_counter()
        sampled = (self.pipeline.take(self.step) if self.pipeline is not None else
                   self.in_flight.pop(0) if self.in_flight and self.in_flight[0].step == self.step else None)
        ahead, sync_seconds = sampled is not None, None  # ahead: sampled beside training, by an older policy
        if sampled is None:
            sampled, sync_seconds = collect_now(self, collect_key)
        collected, version, collect_seconds = sampled.collected, sampled.version, sampled.seconds
        t1 = time.perf_counter()
        self.state, metrics, skipped = algo.update(self.state, collected.batch, self.step, update_key)
        t2 = time.perf_counter()
        if self.pipeline is not None:
            sync_seconds = self.pipeline.push(self.step, lambda: algo.sampler_weights(self.state))
        t3 = time.perf_counter()
        self.data_state = collected.data_state
        metrics = {**metrics, **collected.metrics, f"time/{algo.collect_phase}": collect_seconds,
                   "time/update": t2 - t1, "time/step": t3 - t0}
        if self.pipeline is not None or ahead:
            staleness = float(self.step - 1 - version)
            metrics |= {"time/rollout_wait": t1 - t0, "staleness/mean": staleness, "staleness/max": staleness}
        if sync_seconds is not None:
            metrics["time/weight_sync"] = sync_seconds
        if collected.tokens is not None:
            metrics["tokens_per_second"] = collected.tokens / max(collect_seconds, 1e-9)
        return collected.batch, metrics, skipped

    def run(self) -> dict[str, Any]:
        try:
            with StopRequests() as self.stop_requests:
                return self._run()
        finally:
            self.run_dir.release()

    def _run(self) -> dict[str, Any]:
        c, algo = self.config, self.algorithm
        logger, summary = open_logger(self), {}
        if self.step == 0 and algo.evaluates_before:
            summary["before"] = evaluate(self, logger, "before")
        diverged: dict[str, str] = {}
        try:
            if c.rollout.max_staleness and self.step < c.steps:
                start_pipeline(self)
            while self.step < c.steps and not (diverged and c.monitor.on_divergence == "stop"):
                stop_if_requested(self, logger)
                self.step += 1
                batch, metrics, skipped = self.run_step()
                diverged = self.monitor.diverged(metrics)
                last = self.step == c.steps or bool(diverged and c.monitor.on_divergence == "stop")
                metrics.update(evaluate_if_due(self, logger, batch, summary, last=last))
                verdict = self.monitor.observe(self.step, metrics, skipped=skipped,
                                               no_signal=algo.no_learning_signal(metrics),
                                               max_new_tokens=c.sampling.max_new_tokens)
                record(self, logger, batch, {**metrics, **verdict.metrics}, verdict.messages, summary, last=last)
                if diverged:
                    summary["diverged"] = {"step": self.step, "conditions": diverged}
                    on_divergence(self, logger, diverged)
                elif c.checkpoint_every and self.step % c.checkpoint_every == 0:
                    save_checkpoint(self)
                if verdict.stop:
                    raise TrainingError(f"step {self.step}: {verdict.stop}; stopping. Checkpoints in "
                                        f"{self.checkpointer.directory} are intact "
                                        f"(latest: {self.checkpointer.latest_step()}).")
            finish_steps(self, logger, stopped=bool(diverged) and c.monitor.on_divergence == "stop")
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
                self.pipeline = None
            self.checkpointer.close()
            logger.close()
        return finish(self, summary, diverged)


def collect_now(t: Trainer, collect_key: jax.Array) -> tuple[Sampled, float | None]:
    """This step's rollout collected now by the current policy, timed, and the seconds the weights took to reach the
    sampler's own mesh first (`rollout.sampler_devices`; None when the trainer's mesh samples)."""
    algo, t0 = t.algorithm, time.perf_counter()
    if not t.config.rollout.sampler_devices:
        collected = algo.collect(t.state, t.data_state, collect_key)
        return Sampled(t.step, t.step - 1, collected, time.perf_counter() - t0), None
    weights = jax.block_until_ready(algo.sampler_weights(t.state))
    sync_seconds = time.perf_counter() - t0
    collected = algo.collect_with(weights, t.data_state, host_key(collect_key))
    return Sampled(t.step, t.step - 1, collected, time.perf_counter() - t0 - sync_seconds), sync_seconds


def start_pipeline(t: Trainer) -> None:
    """Start sampling beside training (`rollout.max_staleness > 0`) from the run's step, data position and policy,
    taking over the rollouts a checkpoint held."""
    c, algo = t.config, t.algorithm
    t.pipeline = RolloutPipeline(algo, max_staleness=c.rollout.max_staleness, steps=c.steps,
                                 key_of_step=lambda s: t.step_keys(s)[0], start=t.step,
                                 weights=algo.sampler_weights(t.state), data_state=t.data_state, queued=t.in_flight)
    t.in_flight = []


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpointed_state(t: Trainer) -> State:
    """What a checkpoint saves: the algorithm's state and the run's key (host-side values as replicated global
    arrays, what orbax needs with several processes)."""
    key = global_array(np.asarray(jax.random.key_data(t.key)), t.algorithm.mesh, PartitionSpec())
    return {**t.state, "key": key}


def checkpoint_meta(t: Trainer) -> dict[str, Any]:
    """The checkpoint's metadata: the step, the data position and the divergence streaks."""
    return {"step": t.step, "data_state": dataclasses.asdict(t.data_state),
            "divergence": t.monitor.divergence.to_json()}


def save_checkpoint(t: Trainer) -> None:
    """A checkpoint of the step just finished; sampling beside training, with the rollouts sampled ahead and the
    data position after them (so a resumed run consumes the very rollouts this one would have)."""
    meta = checkpoint_meta(t)
    if t.pipeline is not None:
        queued, data_state = t.pipeline.in_flight(t.step)
        meta |= {"data_state": dataclasses.asdict(data_state), "in_flight": encode_sampled(queued)}
    t.checkpointer.save(t.step, checkpointed_state(t), meta)


def restore(t: Trainer) -> None:
    """Load the latest readable checkpoint into the trainer; `RunDirError` without one."""
    state, meta = t.checkpointer.restore_latest(checkpointed_state(t))
    t.key = jax.random.wrap_key_data(state.pop("key"))
    t.state, t.step = state, int(meta["step"])
    t.data_state = DataState(**meta["data_state"])
    t.monitor.divergence = DivergenceState.from_json(meta.get("divergence"))
    t.in_flight = decode_sampled(meta.get("in_flight", []))


# ---------------------------------------------------------------------------------------------- the steps


def stop_if_requested(t: Trainer, logger: RunLogger) -> None:
    """After a Ctrl-C / SIGTERM: checkpoint the last finished step and raise `RunInterrupted`."""
    requested = t.stop_requests.requested
    if requested is None:
        return
    if t.step > 0 and t.checkpointer.latest_step() != t.step:
        save_checkpoint(t)
    t.checkpointer.wait()
    saved = t.checkpointer.latest_step()
    where = (f"the checkpoint of step {saved} is in {t.checkpointer.directory}; continue with --resume"
             if saved is not None else "no checkpoint had been written yet (nothing to resume)")
    logger.message(f"stopped by {requested} after step {t.step}")
    raise RunInterrupted(f"stopped by {requested} after step {t.step}; {where}", t.step)


def open_logger(t: Trainer) -> RunLogger:
    """The run's logger (metrics.jsonl, samples.jsonl, TensorBoard, W&B), each output claimed by the run first."""
    c = t.config
    for name, used in (("metrics.jsonl", True), ("samples.jsonl", True), ("tensorboard", c.tensorboard),
                       ("wandb", c.logging.wandb)):
        if used:
            t.run_dir.claim(t.out_dir / name)
    logger = RunLogger(t.out_dir, total_steps=c.steps, initial_step=t.step, tensorboard=c.tensorboard,
                       progress_bar=c.progress_bar, desc=t.algorithm.label, resume_step=t.step if t.resumed else None,
                       wandb={"project": c.logging.wandb_project, "mode": c.logging.wandb_mode,
                              "config": dataclasses.asdict(c)} if c.logging.wandb else None)
    logger.message(f"resumed from step {t.step}; writing to {t.out_dir}" if t.resumed else
                   f"writing to {t.out_dir} (a new run; checkpoints every {c.checkpoint_every} steps)"
                   if c.checkpoint_every else f"writing to {t.out_dir} (a new run; checkpoint_every=0)")
    logger.message(t.algorithm.describe())
    return logger


def evaluate(t: Trainer, logger: RunLogger, when: str) -> dict[str, float]:
    """The held-out evaluation of the current state, logged (`when`: "before" is step 0's row)."""
    with t.pipeline.paused() if t.pipeline is not None else contextlib.nullcontext():  # not beside rollouts
        evaluation = t.algorithm.evaluate(t.state, t.config.eval_size or None)
    if evaluation and when == "before":
        logger.log(0, evaluation)
    if evaluation:
        text = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in evaluation.items())
        logger.message(f"held-out evaluation before: {text}" if when == "before" else f"step {t.step}: held-out {text}")
    return evaluation


def evaluate_if_due(t: Trainer, logger: RunLogger, batch: Any, summary: dict[str, Any], *,
                    last: bool) -> dict[str, float]:
    """The held-out evaluation and the drift KL, every `eval_every` steps and at the last (whose evaluation is
    the summary's "after" and shares the last step's metrics row)."""
    c = t.config
    if not (last or (c.eval_every and t.step % c.eval_every == 0)):
        return {}
    out = evaluate(t, logger, "during")
    if last:
        summary["after"] = dict(out)
    if c.monitor.drift_rows:
        out.update(t.algorithm.drift(t.state, batch))
        t.last_drift = out.get("drift_kl", t.last_drift)
    return out


def record(t: Trainer, logger: RunLogger, batch: Any, metrics: dict[str, float], messages: list[str],
           summary: dict[str, Any], *, last: bool) -> None:
    """The monitor's messages, the metrics row, samples, the progress bar and the plain log line."""
    c, algo = t.config, t.algorithm
    for message in messages:
        logger.message(message)
    if t.monitor.symptoms:
        summary["diagnostics"] = t.monitor.symptoms
    if t.step % c.log_every == 0 or last:
        logger.log(t.step, metrics)
    if c.sample_every and (t.step % c.sample_every == 0 or t.step == 1):
        logger.samples(t.step, algo.sample_rows(batch))
    fields = dict(algo.progress(metrics))
    seconds = fields.pop("s/step", None)
    fields.update({"drift": t.last_drift} if t.last_drift is not None else {})
    fields.update({"s/step": seconds} if seconds is not None else {})
    logger.progress(fields)
    if t.step % c.log_every == 0 or last:
        logger.line(t.step, plain_line(fields, metrics))


def on_divergence(t: Trainer, logger: RunLogger, diverged: dict[str, str]) -> None:
    """Report a divergence; under `on_divergence=stop`, set aside the checkpoints written while the collapse built
    up, so the latest checkpoint (and a --resume) is the last good policy."""
    logger.message(f"step {t.step}: the policy diverged: {'; '.join(diverged.values())}")
    if t.config.monitor.on_divergence != "stop":
        if t.config.checkpoint_every and t.step % t.config.checkpoint_every == 0:
            save_checkpoint(t)
        return
    first_bad = t.step - max(t.monitor.divergence.streaks[n] for n in diverged) + 1
    moved = t.checkpointer.set_aside(first_bad, "diverged_checkpoints")
    if moved:
        logger.message(f"checkpoints of steps {moved} moved to diverged_checkpoints/")


def finish_steps(t: Trainer, logger: RunLogger, *, stopped: bool) -> None:
    """After the last step: the final checkpoint (none after a divergence stop), or the weights-only one."""
    c = t.config
    if not stopped:  # a stop asked for during the last step: its checkpoint, no export
        stop_if_requested(t, logger)
    t.stop_requests.phase = "finish"
    if c.checkpoint_every and t.checkpointer.latest_step() != t.step and not stopped:
        save_checkpoint(t)
    if c.final_checkpoint == "weights" and not stopped and t.step == c.steps:
        t.checkpointer.keep_only_weights(t.step, checkpointed_state(t), checkpoint_meta(t))
        logger.message(f"final_checkpoint=weights: checkpoints reduced to the policy weights of step {t.step}")


def finish(t: Trainer, summary: dict[str, Any], diverged: dict[str, str]) -> dict[str, Any]:
    """summary.json; then either `DivergenceError` (stopped on a divergence, no export) or the export."""
    c = t.config
    if "after" not in summary:  # no step ran (the run had reached `steps` already)
        summary["after"] = t.algorithm.evaluate(t.state, c.eval_size or None)
    if not summary["after"]:
        del summary["after"]
    if "diverged" in summary:
        summary["diverged"]["last_good_checkpoint"] = t.checkpointer.latest_step()
    t.run_dir.claim(t.out_dir / "summary.json")
    write_summary(t.out_dir, summary)
    if diverged and c.monitor.on_divergence == "stop":
        good = t.checkpointer.latest_step()
        kept = (f"Last good checkpoint: step {good} in {t.checkpointer.directory}" if good is not None else
                f"No checkpoint was written before it (checkpoint_every={c.checkpoint_every})")
        raise DivergenceError(f"step {t.step}: the policy diverged ({'; '.join(diverged.values())}); stopped without "
                              f"export (monitor.on_divergence=stop). {kept}; lower optim.learning_rate, or resume "
                              f"from a good checkpoint")
    if c.export:
        t.run_dir.claim_export(t.export_dir)
        try:
            summary["export"] = t.algorithm.export(t.state, t.export_dir)
        except Exception as e:
            cause = storage_cause(e)
            if cause is None:
                raise
            raise StorageError(
                f"{cause} while exporting the model to {t.export_dir}; the checkpoints are intact: make room, "
                f"then python -m jaxrl_llm export {t.out_dir} --out {t.export_dir}") from None
        write_summary(t.out_dir, summary)
    return summary


def plain_line(progress: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """The plain log line's fields: the algorithm's progress fields, the shared ones, evaluation, s/step."""
    fields = {k: v for k, v in progress.items() if k != "s/step"}
    for key, label in PLAIN_LINE_FIELDS:
        if key in metrics and label not in fields:
            fields[label] = metrics[key]
    fields.update({k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")})
    if "time/step" in metrics:
        fields["s/step"] = metrics["time/step"]
    return fields


class StopRequests:
    """Ctrl-C (SIGINT) and SIGTERM while a run is open: the first asks the loop to stop after the current step
    (which it checkpoints); a second Ctrl-C stops at once. Handlers are restored on exit; outside the main
    thread (where Python cannot install them) nothing changes."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.phase = "steps"  # "finish": the steps are done; the summary and the export are being written
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = name
        if self.phase == "finish":
            what = "the run's steps are done: finishing its summary and export, then exiting"
        else:
            what = "finishing this step, then saving its checkpoint and stopping (no export)"
        print(f"jaxrl_llm: {name}: {what} (Ctrl-C again stops at once, without saving)", file=sys.stderr,
              flush=True)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
