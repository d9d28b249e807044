"""Calls into user code (environment steps, tools) that cannot stall the caller: each has a deadline, and one still
running at its deadline is abandoned, its worker replaced.

    workers = DeadlineWorkers(8, "jaxrl_llm-env")
    call = workers.submit(env.step, text, deadline=time.monotonic() + 30)
    result = workers.result(call)          # the value, the call's exception, or DeadlineExceeded at the deadline

A Python thread cannot be killed, so a call that hangs keeps its thread; but it never holds a worker another call
needs (a replacement starts), a call still queued at its deadline never starts, the threads are daemons (the
process exits at once at the end of a run, without waiting for them), and at most `max_hung` abandoned calls live
at a time: past that, a new call fails at once with `HungCalls` until some of them end. A worker with nothing to do
for `IDLE_SECONDS` ends (the next call starts one again), so a process that makes many collectors (a notebook, the
test suite) does not keep every one's threads.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

IDLE_SECONDS = 5.0  # how long a worker waits for a call before it ends


class DeadlineExceeded(Exception):
    """The call did not end by its deadline (it was abandoned, or never started)."""


class HungCalls(DeadlineExceeded):
    """The call never started: too many earlier calls are still running past their deadlines."""


class Call:
    """One submitted call: its function, arguments, deadline (`time.monotonic()`), and its future."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], deadline: float) -> None:
        self.fn, self.args, self.deadline = fn, args, deadline
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.abandoned = False


class DeadlineWorkers:
    """`workers` daemon threads running calls in submission order, each call bounded by its deadline (see the
    module docstring); `hung` counts the abandoned calls still running."""

    def __init__(self, workers: int, name: str, max_hung: int | None = None) -> None:
        self.workers, self.name = max(1, workers), name
        self.max_hung = 4 * self.workers if max_hung is None else max_hung
        self.hung = 0
        self._live = 0  # worker threads not abandoned
        self._queue: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, deadline: float) -> Call:
        """Queue `fn(*args)`; it starts only if a worker takes it before `deadline`."""
        call = Call(fn, args, deadline)
        with self._lock:  # queued under the lock: an idle worker ends only when it sees no call waiting
            if self.hung >= self.max_hung:
                call.future.set_exception(HungCalls(
                    f"{self.hung} earlier calls are still running past their deadlines; no new call starts until "
                    f"they end"))
                return call
            self._fill()
            self._queue.put(call)
        return call

    def result(self, call: Call) -> Any:
        """The call's value (or its exception) once it ends; `DeadlineExceeded` at its deadline, when a call still
        running is abandoned and its worker replaced, and a queued one is cancelled."""
        try:
            return call.future.result(timeout=max(0.0, call.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            pass
        except concurrent.futures.CancelledError:  # a worker found it queued past its deadline
            raise DeadlineExceeded("the call was still queued at its deadline") from None
        with self._lock:
            if not call.future.done() and not call.future.cancel():  # running: abandon it, free its worker
                call.abandoned = True
                self.hung += 1
                self._live -= 1
                self._fill()  # the calls queued behind it need a worker now
        if call.future.done() and not call.future.cancelled():  # it ended as the deadline passed
            return call.future.result()
        raise DeadlineExceeded("the call did not end by its deadline")

    def _fill(self) -> None:
        """Start workers up to `workers` (called under the lock)."""
        while self._live < self.workers:
            self._live += 1
            threading.Thread(target=self._work, name=f"{self.name}-{self._live}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                call = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # idle: end (`submit` starts a worker for its call)
                        self._live -= 1
                        return
                continue
            if time.monotonic() >= call.deadline:
                call.future.cancel()
            if not call.future.set_running_or_notify_cancel():
                continue  # cancelled while queued (its deadline passed): never started
            try:
                call.future.set_result(call.fn(*call.args))
            except BaseException as e:  # the call's own failure is its caller's to read
                call.future.set_exception(e)
            with self._lock:
                if call.abandoned:  # a replacement took this worker's place: end here
                    self.hung -= 1
                    return
