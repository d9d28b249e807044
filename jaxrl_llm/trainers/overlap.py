"""Sampling beside training (`rollout.max_staleness: K > 0`, docs/overlap.md): a thread samples the rollouts of
the next steps while the shell updates on the current one.

    policy version v = the updates applied so far (the starting weights are version 0)
    step s's rollout is sampled by version v(s) = max(s - 1 - K, r)      (r: the step a resumed run started from)
    shell:   take rollout s -> update -> push version s (`Algorithm.sampler_weights`) when a later step needs it
    sampler: for s = next, next + 1, ...: wait for version v(s) -> `sample_with(its weights, data, key(s))`
    scorer:  decode and score each sampled rollout (reward functions), in order -> queue

The scorer is a second thread, so a rollout's reward functions run while the sampler samples the next one (and
both run while the shell updates): host work off the critical path. Rollouts whose sampling needs their rewards
(multi-turn episodes, dynamic sampling) are scored in the sampler's thread.

A rollout's version is fixed by its step, not by which side ran faster, so a run is reproducible at a seed and each
update consumes a rollout exactly min(K, s - 1) versions old (never more than K). A whole rollout is sampled by one
version: weights pushed while it is in flight are taken by the next one, so every token of a rollout has the
log-probs of the one policy its version names, which is what the importance correction divides by.

A checkpoint after step s waits for the rollouts of steps s+1 .. s+K (they need versions up to s - 1, all pushed)
and stores them with the data position after them (`encode_sampled`), so `--resume` consumes the very rollouts the
killed run would have: it continues as if nothing had happened.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jaxrl_llm.data import DataState
from jaxrl_llm.sampling import SampleOutput
from jaxrl_llm.trainers.base import Algorithm, Collected
from jaxrl_llm.trainers.rollouts import Rollout


@dataclasses.dataclass
class Sampled:
    """One step's rollout as the sampler made it: the step it is for, the policy version that sampled it, what
    `collect_with` returned, and the sampler's seconds on it."""

    step: int
    version: int
    collected: Collected
    seconds: float = 0.0


def host_key(key: jax.Array) -> jax.Array:
    """`key` rebuilt from host data: uncommitted, so a jit on another mesh (the sampler's) may take it."""
    return jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)))


class PolicyVersions:
    """The policy versions the shell pushed for the sampler: the sampler waits for the version a step samples with;
    closing wakes it with none."""

    def __init__(self, start: int, weights: Any) -> None:
        self._weights: dict[int, Any] = {start: weights}
        self._cond = threading.Condition()
        self._closed = False

    def put(self, version: int, weights: Any) -> None:
        with self._cond:
            self._weights[version] = weights
            self._cond.notify_all()

    def wait(self, version: int) -> Any | None:
        """Policy `version`'s weights once pushed (older ones dropped: no later step samples with them); None once
        closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or version in self._weights)
            if self._closed:
                return None
            for old in [u for u in self._weights if u < version]:
                del self._weights[old]
            return self._weights[version]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def score_sampled(step: int, version: int, finish: Callable[[], Collected], sampling_seconds: float,
                  lock: threading.Lock) -> Sampled:
    """Step `step`'s rollout scored (`finish`, under `lock`), its seconds the sampling's and the scoring's."""
    t0 = time.perf_counter()
    with lock:
        collected = finish()
    return Sampled(step, version, collected, sampling_seconds + time.perf_counter() - t0)


class RolloutPipeline:
    """The sampling thread and the queue between it and the shell (module docstring).

    `key_of_step(s)`: the collect key of step s (the shell's, as in a synchronous run); `start`: the step the run
    resumes from (0 for a new run) and `weights` the sampler's copy of its state's policy; `queued`: rollouts a
    checkpoint held (steps start+1 ..), `data_state` the data position after them."""

    def __init__(self, algorithm: Algorithm, *, max_staleness: int, steps: int,
                 key_of_step: Callable[[int], jax.Array], start: int, weights: Any, data_state: DataState,
                 queued: list[Sampled]) -> None:
        self.algorithm, self.k, self.steps, self.key_of_step = algorithm, max_staleness, steps, key_of_step
        self.start = start
        self.versions = PolicyVersions(start, weights)
        self._queue: dict[int, Future[Sampled]] = {}
        for q in queued:
            self._queue[q.step] = Future()
            self._queue[q.step].set_result(q)
        # one worker: rollouts are scored in order, and a scorer's metrics (reward seconds) are its rollout's own
        self._scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxrl_llm-scorer")
        self._next = start + 1 + len(queued)
        self.data_state = data_state  # the sampler's position: after the last rollout it made
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        # Held while one rollout is sampled: the shell's held-out evaluation takes it too, so the two never share
        # the collector's environments or the engine's pages.
        self.lock = threading.Lock()
        # Held while one rollout is scored: the evaluation takes it too (the tokenizer and the reward functions)
        self.score_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="jaxrl_llm-sampler", daemon=True)
        self.thread.start()

    def version_for(self, step: int) -> int:
        """The policy version that samples step `step`'s rollout."""
        return max(step - 1 - self.k, self.start)

    def _run(self) -> None:
        try:
            while self._next <= self.steps:
                step, version = self._next, self.version_for(self._next)
                weights = self.versions.wait(version)
                if weights is None:  # closed
                    return
                t0 = time.perf_counter()
                with self.lock:
                    data_state, finish = self.algorithm.sample_with(weights, self.data_state,
                                                                    host_key(self.key_of_step(step)))
                sampling = time.perf_counter() - t0
                scored = self._scorer.submit(score_sampled, step, version, finish, sampling, self.score_lock)
                scored.add_done_callback(self._notify)
                with self._cond:
                    self.data_state = data_state
                    self._queue[step] = scored
                    self._next = step + 1
                    self._cond.notify_all()
        except BaseException as e:  # raised again in the shell's thread, where the run reports it
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _notify(self, _: Future) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: ready() or self._error is not None)
            if self._error is not None:
                raise self._error

    def _ready(self, step: int) -> bool:
        return step in self._queue and self._queue[step].done()

    def take(self, step: int) -> Sampled:
        """Step `step`'s rollout, waiting for the sampler and the scorer if it is not there yet (a scorer's
        error is raised here)."""
        self._wait(lambda: self._ready(step))
        with self._cond:
            return self._queue.pop(step).result()

    def needs(self, version: int) -> bool:
        """Whether a step still to be sampled samples with policy `version`."""
        return version + 1 + self.k <= self.steps

    def push(self, version: int, weights: Callable[[], Any]) -> float:
        """Hand the sampler policy `version` (made by `weights()`, timed) when a later step samples with it;
        returns the seconds it took (0 when none does)."""
        if not self.needs(version):
            return 0.0
        t0 = time.perf_counter()
        pushed = jax.block_until_ready(weights())
        seconds = time.perf_counter() - t0
        self.versions.put(version, pushed)
        return seconds

    def in_flight(self, step: int) -> tuple[list[Sampled], DataState]:
        """After the update of `step`: the rollouts of steps step+1 .. step+K (at most `steps`), waited for, and
        the data position after the last of them; what a checkpoint of `step` stores."""
        last = min(step + self.k, self.steps)
        self._wait(lambda: all(self._ready(s) for s in range(step + 1, last + 1)))
        with self._cond:
            queued = [self._queue[s].result() for s in range(step + 1, last + 1)]
            # none queued: `step` is the run's last, and the sampler's position is the one after it
            return queued, queued[-1].collected.data_state if queued else self.data_state

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Neither a rollout sampled nor one scored meanwhile: what the held-out evaluation runs under."""
        with self.lock, self.score_lock:
            yield

    def close(self) -> None:
        """Stop the sampler after the rollout in flight (the thread is a daemon: a run that fails does not wait
        longer than a minute for it)."""
        self.versions.close()
        self.thread.join(timeout=60.0)
        self._scorer.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- checkpoints

_CLASSES: dict[str, type] = {"Rollout": Rollout, "SampleOutput": SampleOutput, "DataState": DataState,
                             "Collected": Collected, "Sampled": Sampled}


def _encode(x: Any) -> Any:
    if isinstance(x, (np.ndarray, jax.Array, np.generic)) and not isinstance(x, (bool, int, float)):
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(x), allow_pickle=False)
        return {"__ndarray__": base64.b64encode(buffer.getvalue()).decode("ascii")}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__class__": type(x).__name__, **{f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"__class__": type(x).__name__, **{k: _encode(v) for k, v in x._asdict().items()}}
    if isinstance(x, dict):
        return {"__dict__": {str(k): _encode(v) for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__ndarray__" in x:
        return np.load(io.BytesIO(base64.b64decode(x["__ndarray__"])), allow_pickle=False)
    if "__dict__" in x:
        return {k: _decode(v) for k, v in x["__dict__"].items()}
    cls = _CLASSES[x["__class__"]]
    return cls(**{k: _decode(v) for k, v in x.items() if k != "__class__"})


def encode_sampled(queued: list[Sampled]) -> list[Any]:
    """Rollouts in flight as JSON (arrays as base64 `.npy`, no pickle): a checkpoint's metadata."""
    return [_encode(q) for q in queued]


def decode_sampled(data: list[Any]) -> list[Sampled]:
    """The rollouts `encode_sampled` stored."""
    return [_decode(q) for q in data]
