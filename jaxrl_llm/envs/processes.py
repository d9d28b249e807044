"""Watching an untrusted program from outside (`jaxrl_llm.envs.sandbox`'s processes): its output drained from both
pipes within a byte limit and a deadline, its process count held where RLIMIT_NPROC does not bind, and its whole
process group killed. Host-side only: nothing here runs inside the sandbox."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from pathlib import Path


class ProcessWatch:
    """Counts a run's processes from outside, where RLIMIT_NPROC does not bind (the code runs as host root): in
    bwrap those of its PID namespace, which none can leave; else those of its process group."""

    def __init__(self, pid: int, mode: str, max_processes: int) -> None:
        self.pid, self.mode, self.max_processes = pid, mode, max_processes
        self.namespace = ""  # bwrap's PID namespace, known once its first child is up
        self.exceeded = False
        self.next_check = 0.0

    def check(self) -> bool:
        """Whether the run has more processes than allowed (then it is killed); at most every 20 ms."""
        now = time.monotonic()
        if self.exceeded or now < self.next_check:
            return self.exceeded
        self.next_check = now + 0.02
        count = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if self.mode == "bwrap":
                    if not self.namespace:
                        stat = Path(f"/proc/{entry}/stat").read_text()
                        if int(stat[stat.rindex(")") + 2 :].split()[1]) == self.pid:  # bwrap's child: PID 1 there
                            self.namespace = os.readlink(f"/proc/{entry}/ns/pid")
                    count += bool(self.namespace) and os.readlink(f"/proc/{entry}/ns/pid") == self.namespace
                else:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    count += int(stat[stat.rindex(")") + 2 :].split()[2]) == self.pid
            except (OSError, ValueError, IndexError):
                continue  # it exited while we looked
        if count > self.max_processes:
            self.exceeded = True
            kill_group(self.pid)
        return self.exceeded


def collect_output(proc: subprocess.Popen[bytes], deadline: float, limit: int,
             watch: ProcessWatch | None) -> tuple[bytes, bytes, bool, bool]:
    """`(stdout head, stderr tail, truncated, timed_out)`: both pipes drained as they fill, keeping at most `limit`
    bytes of each, until the program exits (and its pipes are empty), the deadline passes or `watch` kills it."""
    out, err = bytearray(), bytearray()
    truncated = exited = False
    with selectors.DefaultSelector() as sel:
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(out), bytes(err), truncated, True
            # Once it has exited, only what is already in the pipes counts: a child it left behind holding them
            # open does not keep the run going (it is killed with the group).
            events = sel.select(0 if exited else min(remaining, 0.02))
            if not events and exited:
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf: bytearray = key.data
                room = limit - len(buf)
                truncated = truncated or len(chunk) > room
                if buf is out:
                    # Past the limit stdout is read and dropped, so the program runs on to its exit status.
                    buf += chunk[: max(0, room)]
                else:
                    buf += chunk
                    del buf[: max(0, len(buf) - limit)]
            if watch is not None and watch.check():
                return bytes(out), bytes(err), truncated, False
            # Not reaped (WNOWAIT): the group's id stays reserved until the group is killed.
            exited = exited or os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    while not exited:
        if time.monotonic() >= deadline:
            return bytes(out), bytes(err), truncated, True
        if watch is not None and watch.check():
            return bytes(out), bytes(err), truncated, False
        time.sleep(0.005)
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    return bytes(out), bytes(err), truncated, False


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group; quiet when none is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
