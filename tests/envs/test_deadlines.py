"""Calls into user code with a deadline (jaxrl_llm/envs/deadlines.py): a hung call is abandoned at its deadline and
never holds a worker, a queued call never starts past its deadline, hung calls are bounded, and a process with a
hung call exits at once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from jaxrl_llm.envs.deadlines import DeadlineExceeded, DeadlineWorkers, HungCalls
from jaxrl_llm.envs.tools import TOOL_WORKERS, Tool, ToolCall, call_tool


def test_a_hung_call_is_abandoned_at_its_deadline_and_its_worker_replaced() -> None:
    release = threading.Event()
    workers = DeadlineWorkers(1, "test")
    hung = workers.submit(release.wait, 600, deadline=time.monotonic() + 0.2)
    with pytest.raises(DeadlineExceeded):
        workers.result(hung)
    assert workers.hung == 1 and not hung.future.done()
    # The one worker is hung, yet the next call runs at once on its replacement.
    assert workers.result(workers.submit(lambda x: 2 * x, 21, deadline=time.monotonic() + 60)) == 42
    release.set()  # the abandoned call ends: it is no longer counted
    for _ in range(500):
        if workers.hung == 0:
            break
        time.sleep(0.01)
    assert workers.hung == 0 and hung.future.result() is True


def test_a_call_still_queued_at_its_deadline_never_starts() -> None:
    release, started = threading.Event(), threading.Event()
    workers = DeadlineWorkers(1, "test")
    deadline = time.monotonic() + 0.2
    first = workers.submit(release.wait, 600, deadline=deadline)
    queued = workers.submit(started.set, deadline=deadline)  # behind the hung one on the only worker
    for call in (first, queued):
        with pytest.raises(DeadlineExceeded):
            workers.result(call)
    assert queued.future.cancelled()
    release.set()
    time.sleep(0.2)
    assert not started.is_set()  # cancelled at its deadline: it never ran, even once a worker was free


def test_hung_calls_are_bounded_and_past_the_bound_a_call_fails_at_once() -> None:
    release, ran = threading.Event(), threading.Event()
    workers = DeadlineWorkers(2, "test", max_hung=3)
    for _ in range(3):
        with pytest.raises(DeadlineExceeded):
            workers.result(workers.submit(release.wait, 600, deadline=time.monotonic() + 0.05))
    threads = threading.active_count()
    refused = workers.submit(ran.set, deadline=time.monotonic() + 60)
    with pytest.raises(HungCalls, match="3 earlier calls are still running past their deadlines"):
        workers.result(refused)
    assert not ran.is_set() and threading.active_count() == threads  # no thread started for it
    release.set()
    for _ in range(500):
        if workers.hung == 0:
            break
        time.sleep(0.01)
    assert workers.result(workers.submit(ran.set, deadline=time.monotonic() + 60)) is None and ran.is_set()


def test_a_call_that_raises_gives_its_exception_to_the_caller() -> None:
    workers = DeadlineWorkers(1, "test")

    def fail() -> None:
        raise TimeoutError("the environment's own socket timed out")  # not the deadline: its own error

    with pytest.raises(TimeoutError, match="own socket"):
        workers.result(workers.submit(fail, deadline=time.monotonic() + 60))


def test_a_process_with_a_hung_call_exits_at_once() -> None:
    program = ("import time\nfrom jaxrl_llm.envs.deadlines import DeadlineExceeded, DeadlineWorkers\n"
               "w = DeadlineWorkers(1, 'test')\n"
               "try:\n    w.result(w.submit(time.sleep, 600, deadline=time.monotonic() + 0.1))\n"
               "except DeadlineExceeded:\n    print('abandoned', w.hung)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.stdout == "abandoned 1\n", out.stderr
    assert time.monotonic() - t0 < 60  # not the 600 s of the hung call: nothing waits for it at exit


def test_a_tool_that_hangs_answers_an_error_at_its_timeout_and_holds_no_tool_worker() -> None:
    release = threading.Event()
    hanging = Tool("hang", "hangs", {"type": "object", "properties": {}}, lambda: str(release.wait(600)),
                   timeout_s=0.2)
    echo = Tool("echo", "echoes", {"type": "object", "properties": {"text": {"type": "string"}},
                                   "required": ["text"]}, lambda text: text)
    tools = {"hang": hanging, "echo": echo}
    before = TOOL_WORKERS.hung
    for _ in range(TOOL_WORKERS.workers + 1):  # more hung calls than there are tool workers
        assert call_tool(tools, ToolCall("hang", {})) == ("error: hang took longer than 0.2 s", False)
    assert TOOL_WORKERS.hung == before + TOOL_WORKERS.workers + 1
    assert call_tool(tools, ToolCall("echo", {"text": "still here"})) == ("still here", True)
    release.set()


def test_idle_workers_end_and_the_next_call_starts_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with nothing to do ends after `IDLE_SECONDS` (a process that makes many collectors keeps no idle
    threads: the suite's workers once held over 100), and a later call still runs."""
    from jaxrl_llm.envs import deadlines

    monkeypatch.setattr(deadlines, "IDLE_SECONDS", 0.05)
    workers = DeadlineWorkers(4, "idle-test")
    calls = [workers.submit(lambda x: x + 1, i, deadline=time.monotonic() + 60) for i in range(8)]
    assert [workers.result(c) for c in calls] == list(range(1, 9))

    def live() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("idle-test-")]

    for _ in range(500):
        if not live():
            break
        time.sleep(0.01)
    assert not live() and workers._live == 0
    assert workers.result(workers.submit(lambda: "again", deadline=time.monotonic() + 60)) == "again"
    assert 0 < len(live()) <= workers.workers  # the pool started again
