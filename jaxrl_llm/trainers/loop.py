"""The loop shell: the one place a run's side effects live, whatever the algorithm.

    open out_dir (lock, refuse/overwrite, resume checks) -> build the algorithm -> [restore the checkpoint]
    -> evaluate before -> for each step:  key -> algorithm.collect -> algorithm.update -> metrics
       -> divergence and skip guards -> evaluation (+ drift KL) / diagnostics / logs / samples / checkpoint
    -> summary, export
    (Ctrl-C / SIGTERM: the step in flight finishes, is checkpointed, and `RunInterrupted` ends the run.)

An algorithm (GRPO family, PPO, SFT, reward model: `trainers/__init__.ALGORITHMS`) supplies its state and four
steps, and never touches files:

    init(config)                 build models, optimizers and jitted functions
    collect(data_state, key)     -> (batch, data_state, metrics)      sample and score, or read examples
    update(batch, step, key)     -> metrics                            one jitted update (epochs x minibatches)
    state() / load_state(tree)   the pytree a checkpoint holds
    evaluate(limit), export(dir), progress(metrics), sample_rows(batch), describe()
    drift(batch) (optional)      -> {"drift_kl": KL(pi || pi_initial) per token}, at evaluation steps

Every step's metrics also go through `diagnostics.diagnose` (named symptoms: a log line with a hint when one
starts, `diagnostics/<name>` metrics while it holds, their steps in summary.json under "diagnostics").
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.data import DataState
from jaxrl_llm.errors import DivergenceError, RunInterrupted, StorageError, TrainingError
from jaxrl_llm.run.checkpoint import Checkpointer, storage_cause
from jaxrl_llm.run.diagnostics import DiagnosticLimits, describe, diagnose, diagnostic_metrics
from jaxrl_llm.run.divergence import DivergenceLimits, DivergenceState, update_divergence
from jaxrl_llm.run.logging import RunLogger, write_summary
from jaxrl_llm.run.run_dir import open_run_dir
from jaxrl_llm.sharding import global_array

MAX_CONSECUTIVE_SKIPPED_UPDATES = 5
TRUNCATION_WARNING = 0.5  # a step where at least this share of completions hit sampling.max_new_tokens is named
NO_SIGNAL_REPEAT = 10  # a run of steps without learning signal is named at its first step and every N after

# The plain log line (not on a terminal): these metrics, when the step has them, after the algorithm's own.
PLAIN_LINE_FIELDS = (("reward/mean", "reward"), ("kl", "kl"), ("drift_kl", "drift"), ("entropy", "entropy"),
                     ("frac_zero_std_groups", "zero_std_groups"), ("frac_truncated", "truncated"))


class Algorithm(Protocol):
    """What the loop shell asks of an algorithm (see the module docstring). Optional class attributes, read
    with defaults: `collect_phase` ("rollout"; "data" for algorithms that read examples: names
    `time/<phase>`), `evaluates_before` (True: evaluate the starting model before step 1), `from_scratch`
    (False: the run reads `model.path`, which an export must not overwrite)."""

    label: ClassVar[str]  # the progress bar's name
    mesh: Any
    vocab_size: int

    def __init__(self, config: RunConfig) -> None: ...
    def describe(self) -> str: ...
    def state(self) -> dict[str, Any]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...
    def collect(self, data_state: DataState, key: jax.Array) -> tuple[Any, DataState, dict[str, float]]: ...
    def update(self, batch: Any, step: int, key: jax.Array) -> dict[str, float]: ...
    def evaluate(self, limit: int | None) -> dict[str, float]: ...
    def progress(self, metrics: dict[str, float]) -> dict[str, float]: ...
    def sample_rows(self, batch: Any) -> list[dict[str, Any]]: ...
    def export(self, directory: Path) -> str: ...


class Trainer:
    """One run of `algorithm_cls` in `config.out_dir`; `run()` executes the steps up to `config.steps`.

    `resume`: continue from the latest readable checkpoint; `overwrite`: start over in an out_dir that holds a
    run; `allow_config_change`: resume with math-changing settings (see `run_dir.open_run_dir`)."""

    def __init__(self, config: RunConfig, algorithm_cls: type[Algorithm], *, resume: bool = False,
                 overwrite: bool = False, allow_config_change: bool = False, config_dir: str | Path | None = None,
                 allow_tracked_dir: bool = False) -> None:
        self.config = c = config
        self.out_dir = Path(c.out_dir)
        self.resumed = resume
        self.run_dir = open_run_dir(c, resume=resume, overwrite=overwrite, allow_config_change=allow_config_change,
                                    export_dir=self.export_dir if c.export else None,
                                    input_dirs=_input_dirs(c, algorithm_cls), config_dir=config_dir,
                                    allow_tracked_dir=allow_tracked_dir)
        try:
            if _input_dirs(c, algorithm_cls) == ():  # a from-scratch model saves its tokenizer in the run
                self.run_dir.claim(self.out_dir / "tokenizer")
            self.algorithm = algorithm_cls(c)
            self.root_key = jax.random.key(c.seed)
            self.step = 0
            self.data_state = DataState()
            self.divergence = DivergenceState()
            self.history: list[dict[str, float]] = []  # every step's metrics, for the diagnostics
            self.symptoms: dict[str, dict[str, int]] = {}  # name -> first_step, last_step, steps
            self.last_drift: float | None = None
            self.checkpointer = Checkpointer(self.out_dir / "checkpoints", keep=c.keep_checkpoints,
                                             claim=self.run_dir.claim)
            if resume:
                self.restore()
        except BaseException:
            self.run_dir.release()
            raise

    @property
    def export_dir(self) -> Path:
        return Path(self.config.export_dir or Path(self.config.out_dir) / "hf")

    # ------------------------------------------------------------------------------------------ checkpoints

    def _state(self) -> dict[str, Any]:
        # Host-side values are saved as replicated global arrays (what orbax needs with several processes).
        key = global_array(np.asarray(jax.random.key_data(self.root_key)), self.algorithm.mesh, PartitionSpec())
        return {**self.algorithm.state(), "key": key}

    def restore(self) -> None:
        """Load the latest readable checkpoint; `RunDirError` without one."""
        state, meta = self.checkpointer.restore_latest(self._state())
        self.root_key = jax.random.wrap_key_data(state.pop("key"))
        self.algorithm.load_state(state)
        self.step = int(meta["step"])
        self.data_state = DataState(**meta["data_state"])
        self.divergence = DivergenceState.from_json(meta.get("divergence"))

    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "data_state": dataclasses.asdict(self.data_state),
                "divergence": self.divergence.to_json()}

    def save_checkpoint(self) -> None:
        self.checkpointer.save(self.step, self._state(), self._meta())

    def _stop_if_requested(self, logger: RunLogger) -> None:
        """After a Ctrl-C / SIGTERM: checkpoint the last finished step and raise `RunInterrupted`."""
        requested = self.stop_requests.requested
        if requested is None:
            return
        if self.step > 0 and self.checkpointer.latest_step() != self.step:
            self.save_checkpoint()
        self.checkpointer.wait()
        saved = self.checkpointer.latest_step()
        where = (f"the checkpoint of step {saved} is in {self.checkpointer.directory}; continue with --resume"
                 if saved is not None else "no checkpoint had been written yet (nothing to resume)")
        logger.message(f"stopped by {requested} after step {self.step}")
        raise RunInterrupted(f"stopped by {requested} after step {self.step}; {where}", self.step)

    # ------------------------------------------------------------------------------------------ the loop

    def run_step(self) -> tuple[Any, dict[str, float]]:
        """Collect and update once (`self.step` already advanced); the batch and the step's metrics."""
        algo = self.algorithm
        key = jax.random.fold_in(self.root_key, self.step)
        collect_key, update_key = jax.random.split(key)
        t0 = time.perf_counter()
        batch, self.data_state, collected = algo.collect(self.data_state, collect_key)
        t1 = time.perf_counter()
        metrics = algo.update(batch, self.step, update_key)
        t2 = time.perf_counter()
        tokens = collected.pop("completion_tokens", None)
        metrics.update(collected)
        phase = getattr(algo, "collect_phase", "rollout")
        metrics.update({f"time/{phase}": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0})
        if tokens is not None:
            metrics["tokens_per_second"] = tokens / max(t1 - t0, 1e-9)
        metrics.setdefault("last_update_skipped", metrics.get("update_skipped", 0.0))
        return batch, metrics

    def run(self) -> dict[str, Any]:
        try:
            with StopRequests() as self.stop_requests:
                return self._run()
        finally:
            self.run_dir.release()

    def _run(self) -> dict[str, Any]:
        c, algo = self.config, self.algorithm
        for name, used in (("metrics.jsonl", True), ("samples.jsonl", True), ("tensorboard", c.tensorboard),
                           ("wandb", c.logging.wandb)):
            if used:
                self.run_dir.claim(self.out_dir / name)
        logger = RunLogger(self.out_dir, total_steps=c.steps, initial_step=self.step, tensorboard=c.tensorboard,
                           progress_bar=c.progress_bar, desc=algo.label,
                           resume_step=self.step if self.resumed else None,
                           wandb={"project": c.logging.wandb_project, "mode": c.logging.wandb_mode,
                                  "config": dataclasses.asdict(c)} if c.logging.wandb else None)
        logger.message(f"resumed from step {self.step}; writing to {self.out_dir}" if self.resumed else
                       f"writing to {self.out_dir} (a new run; checkpoints every {c.checkpoint_every} steps)"
                       if c.checkpoint_every else f"writing to {self.out_dir} (a new run; checkpoint_every=0)")
        logger.message(algo.describe())
        summary: dict[str, Any] = {}
        if self.step == 0 and getattr(algo, "evaluates_before", True):
            summary["before"] = algo.evaluate(c.eval_size or None)
            if summary["before"]:
                logger.log(0, summary["before"])
                logger.message(f"held-out evaluation before: {_eval_text(summary['before'])}")
        limits = DivergenceLimits(**dataclasses.asdict(c.divergence))
        diverged: dict[str, str] = {}
        flagged: dict[str, Any] = {}  # the latest divergence (on_divergence=warn runs on past it)
        skipped_in_a_row = no_signal_in_a_row = 0
        warned_truncation = False
        try:
            while self.step < c.steps:
                self._stop_if_requested(logger)
                self.step += 1
                batch, metrics = self.run_step()
                skipped_in_a_row = skipped_in_a_row + 1 if metrics.pop("last_update_skipped") else 0
                self.divergence, diverged = update_divergence(self.divergence, metrics, vocab_size=algo.vocab_size,
                                                              limits=limits)
                last = self.step == c.steps or (diverged and c.on_divergence == "stop")
                self._record(logger, batch, metrics, summary, last)
                no_signal_in_a_row = no_signal_in_a_row + 1 if _no_learning_signal(metrics, c.algo) else 0
                if no_signal_in_a_row % NO_SIGNAL_REPEAT == 1:
                    logger.message(f"warning: step {self.step}: no learning signal ({_no_signal_text(metrics)}): "
                                   f"the update changes nothing (every group's completions scored alike, or "
                                   f"a zero gradient); "
                                   f"read samples.jsonl, check the reward function, or raise "
                                   f"sampling.temperature / rl.group_size")
                if not warned_truncation and metrics.get("frac_truncated", 0.0) >= TRUNCATION_WARNING:
                    warned_truncation = True
                    logger.message(f"warning: step {self.step}: {metrics['frac_truncated']:.0%} of the completions "
                                   f"were cut at sampling.max_new_tokens={c.sampling.max_new_tokens}; raise it "
                                   f"if the answers need more tokens")
                if diverged:
                    flagged = {"step": self.step, "conditions": diverged}
                    if self._on_divergence(logger, diverged):
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
            if not stopped:  # a stop asked for during the last step: its checkpoint, no export
                self._stop_if_requested(logger)
            self.stop_requests.phase = "finish"
            if c.checkpoint_every and self.checkpointer.latest_step() != self.step and not stopped:
                self.save_checkpoint()
            if c.final_checkpoint == "weights" and not stopped and self.step == c.steps:
                self.checkpointer.keep_only_weights(self.step, self._state(), self._meta())
                logger.message(f"final_checkpoint=weights: checkpoints reduced to the policy weights of step "
                               f"{self.step}")
        finally:
            self.checkpointer.close()
            logger.close()
        return self._finish(summary, diverged, flagged)

    def _record(self, logger: RunLogger, batch: Any, metrics: dict[str, float], summary: dict[str, Any],
                last: bool) -> None:
        """Evaluation (every `eval_every` steps and at the last) with the drift KL, the diagnostics, the metrics
        row, samples and the progress bar."""
        c, algo = self.config, self.algorithm
        if last or (c.eval_every and self.step % c.eval_every == 0):
            evaluation = algo.evaluate(c.eval_size or None)  # the final evaluation shares the last step's row
            metrics.update(evaluation)
            if evaluation:
                logger.message(f"step {self.step}: held-out {_eval_text(evaluation)}")
            if last:
                summary["after"] = evaluation
            if c.diagnostics.drift_rows and hasattr(algo, "drift"):
                metrics.update(algo.drift(batch))
                self.last_drift = metrics.get("drift_kl", self.last_drift)
        self._diagnose(logger, metrics, summary)
        if self.step % c.log_every == 0 or last:
            logger.log(self.step, metrics)
        if c.sample_every and (self.step % c.sample_every == 0 or self.step == 1):
            logger.samples(self.step, algo.sample_rows(batch))
        progress = self._progress(metrics)
        logger.progress(progress)
        if self.step % c.log_every == 0 or last:
            logger.line(self.step, _plain_line(progress, metrics))

    def _progress(self, metrics: dict[str, float]) -> dict[str, float]:
        """The algorithm's progress fields with the latest drift KL before the step time."""
        fields = dict(self.algorithm.progress(metrics))
        seconds = fields.pop("s/step", None)
        if self.last_drift is not None:
            fields["drift"] = self.last_drift
        if seconds is not None:
            fields["s/step"] = seconds
        return fields

    def _diagnose(self, logger: RunLogger, metrics: dict[str, float], summary: dict[str, Any]) -> None:
        """Name this step's symptoms: a message at each one's start, `diagnostics/*` metrics, the summary."""
        d = dataclasses.asdict(self.config.diagnostics)
        d.pop("drift_rows")
        self.history.append({k: v for k, v in metrics.items() if not k.startswith("diagnostics/")})
        found = diagnose(self.history, DiagnosticLimits(**d))
        for name, detail in found.items():
            seen = self.symptoms.get(name)
            if seen is None or seen["last_step"] != self.step - 1:
                logger.message(f"warning: step {self.step}: {describe(name, detail)}")
            if seen is None:
                seen = self.symptoms[name] = {"first_step": self.step, "last_step": self.step, "steps": 0}
            seen["last_step"], seen["steps"] = self.step, seen["steps"] + 1
        if self.config.diagnostics.enabled:
            metrics.update(diagnostic_metrics(found))
        if self.symptoms:
            summary["diagnostics"] = self.symptoms

    def _on_divergence(self, logger: RunLogger, diverged: dict[str, str]) -> bool:
        """Report a divergence; with `on_divergence=stop`, set aside the checkpoints written while the collapse
        built up (so the latest checkpoint, and a --resume, is the last good policy) and return True."""
        logger.message(f"step {self.step}: the policy diverged: {'; '.join(diverged.values())}")
        if self.config.on_divergence != "stop":
            return False
        first_bad = self.step - max(self.divergence.streaks[n] for n in diverged) + 1
        moved = self.checkpointer.set_aside(first_bad, "diverged_checkpoints")
        if moved:
            logger.message(f"checkpoints of steps {moved} moved to diverged_checkpoints/")
        return True

    def _finish(self, summary: dict[str, Any], diverged: dict[str, str], flagged: dict[str, Any]) -> dict[str, Any]:
        """summary.json; then either `DivergenceError` (stopped on a divergence, no export) or the export."""
        c, algo = self.config, self.algorithm
        if "after" not in summary:  # no step ran (the run had reached `steps` already)
            summary["after"] = algo.evaluate(c.eval_size or None)
        if not summary["after"]:
            del summary["after"]
        if flagged:
            summary["diverged"] = {**flagged, "last_good_checkpoint": self.checkpointer.latest_step()}
        self.run_dir.claim(self.out_dir / "summary.json")
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
            self.run_dir.claim_export(self.export_dir)
            try:
                summary["export"] = algo.export(self.export_dir)
            except Exception as e:
                cause = storage_cause(e)
                if cause is None:
                    raise
                raise StorageError(
                    f"{cause} while exporting the model to {self.export_dir}; the checkpoints are intact: make room, "
                    f"then python -m jaxrl_llm.export {self.out_dir} --out {self.export_dir}") from None
            write_summary(self.out_dir, summary)
        return summary


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


def _no_learning_signal(metrics: dict[str, float], algo: str) -> bool:
    """The update had nothing to learn from: a zero gradient, or (group-relative advantages) no group whose
    completions scored differently. PPO's critic makes advantages without reward variance, so only its
    gradient counts."""
    zero_grad = metrics.get("grad_norm", 1.0) == 0.0 and not metrics.get("update_skipped", 0.0)
    return zero_grad or (algo != "ppo" and metrics.get("frac_zero_std_groups", 0.0) == 1.0)


def _no_signal_text(metrics: dict[str, float]) -> str:
    parts = [f"{k}={metrics[k]:.3g}" for k in ("frac_zero_std_groups", "grad_norm") if k in metrics]
    return ", ".join(parts)


def _plain_line(progress: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
    """The plain log line's fields: the algorithm's progress fields, the shared ones, evaluation, s/step."""
    fields = {k: v for k, v in progress.items() if k != "s/step"}
    for key, label in PLAIN_LINE_FIELDS:
        if key in metrics and label not in fields:
            fields[label] = metrics[key]
    fields.update({k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")})
    if "time/step" in metrics:
        fields["s/step"] = metrics["time/step"]
    return fields


def _input_dirs(c: RunConfig, algorithm_cls: type[Algorithm]) -> tuple[str, ...]:
    """The directories a run reads (the model), which its outputs must not overwrite."""
    from_scratch = getattr(algorithm_cls, "from_scratch", False) and bool(c.model.init)
    return () if from_scratch else (c.model.path,)


def _eval_text(evaluation: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in evaluation.items())
