"""Run untrusted Python (a model's code) under resource limits, in bubblewrap (`bwrap`) with a minimal view of
the filesystem, or, only when the user opts in by name, in a plain subprocess. docs/sandbox.md says what each mode
enforces and what the code sees.

    result = run_python("print(6 * 7)", timeout_s=2)     SandboxResult(stdout="42\\n", ..., mode="bwrap")
    result.observation()                                 what a model sees: output, errors, a note on limits
    sandbox_problem("bwrap")                             "" when that mode can run code here, else one line why

A call never raises and never outlives its wall-clock timeout by more than the time it takes to kill the process:
broken or hostile code (a loop, a fork bomb, a huge allocation or output) comes back as an error observation. The
mode is `run_python(mode=...)`, else the run's `env.sandbox` (`use_sandbox`), else `JAXRL_LLM_SANDBOX`, else
bwrap. Where bwrap is missing and nobody opted in, no code runs: the result says how to install bubblewrap.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jaxrl_llm.config.schema import SANDBOX_MODES
from jaxrl_llm.envs.processes import ProcessWatch, collect_output, kill_group

SANDBOX_ENV = "JAXRL_LLM_SANDBOX"
# The largest file the code may write (RLIMIT_FSIZE) and, under bwrap, the size of each of its tmpfs mounts
# (/tmp, which holds the work dir, and /dev/shm): what it writes lives in memory and dies with the sandbox.
DISK_MB = 64
OPEN_FILES = 64  # RLIMIT_NOFILE
STDERR_TAIL_CHARS = 2000  # of stderr in `observation()`: a traceback's end says what went wrong
NOBODY = 65534  # the uid and gid the code runs as when the caller is root: rlimits on processes bind only non-root
WORK_DIR = "/tmp/work"  # the work dir's path inside bwrap (/ is read-only there, so it lives in the /tmp tmpfs)

# Runs first inside the sandbox: it lowers the limits, then replaces itself with the user's program, so no line of
# that program runs without them. A limit is never raised above the hard limit it inherits (non-root can't).
_LAUNCHER = """\
import os, resource, sys
names = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")
for name, value in zip(names, map(int, sys.argv[1:])):
    res = getattr(resource, name)
    hard = resource.getrlimit(res)[1]
    inf = hard == resource.RLIM_INFINITY
    soft = value if inf else min(value, hard)
    # CPU: SIGXCPU at the soft limit (reported as the CPU limit), then SIGKILL a second later if it is caught.
    new_hard = soft + 1 if name == "RLIMIT_CPU" and (inf or soft + 1 <= hard) else soft
    resource.setrlimit(res, (soft, new_hard))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""

_SIGNAL_REASONS = {
    signal.SIGXCPU: "the CPU time limit",
    signal.SIGXFSZ: "the file size limit",
    signal.SIGKILL: "a limit (CPU time or memory) or the sandbox",
    signal.SIGSEGV: "a crash",
}


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run produced: its (bounded) output, exit status, and which limits cut it short."""

    stdout: str  # the first max_output_bytes bytes
    stderr: str  # the last max_output_bytes bytes (a traceback ends there)
    returncode: int | None  # negative: killed by that signal; None: it never ran, or was killed at the timeout
    timed_out: bool
    truncated: bool  # a stream was longer than max_output_bytes
    mode: str  # "bwrap" or "subprocess"

    def note(self) -> str:
        """A one-line account of how the run ended, or "" for a clean exit."""
        notes = []
        if self.timed_out:
            notes.append("timed out: killed at the wall-clock limit")
        elif self.returncode is None:
            notes.append("the sandbox could not run the code")
        elif self.returncode < 0:
            try:
                sig = signal.Signals(-self.returncode)
                notes.append(f"killed by {sig.name} ({_SIGNAL_REASONS.get(sig, 'a signal')})")
            except ValueError:
                notes.append(f"killed by signal {-self.returncode}")
        elif self.returncode > 0:
            notes.append(f"exit status {self.returncode}")
        if self.truncated:
            notes.append("output truncated (stdout keeps its start, stderr its end)")
        return "; ".join(notes)

    def observation(self) -> str:
        """What a model sees: stdout, then the end of stderr, then a bracketed note when the run did not end
        cleanly."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr[-STDERR_TAIL_CHARS:].rstrip("\n"))
        note = self.note()
        if note:
            parts.append(f"[{note}]")
        return "\n".join(parts) if parts else "[no output]"


INSTALL_BWRAP = "install bubblewrap (apt-get install bubblewrap, or dnf install bubblewrap)"
OPT_IN = ("or opt in to a plain subprocess without isolation by name: env.sandbox: subprocess in a run "
          f"({SANDBOX_ENV}=subprocess outside one); docs/sandbox.md")
# What bwrap shows the code besides its interpreter, read-only: the system's programs and shared libraries
# (/usr, and /bin, /lib, ... as the links into it that a merged /usr makes them, or as directories), the dynamic
# loader's cache (where it finds those libraries) and the local time zone (time.localtime). /etc/passwd and
# /etc/group are the sandbox's own (root and nobody), so user lookups work without the host's accounts.
SYSTEM_DIRS = ("/usr",)
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_PASSWD = (f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
           f"nobody:x:{NOBODY}:{NOBODY}:nobody:{WORK_DIR}:/usr/sbin/nologin\n")
_GROUP = f"root:x:0:\nnogroup:x:{NOBODY}:\n"


@dataclass(frozen=True)
class Interpreter:
    """The Python that runs the code: its executable (directories resolved, so the path exists under bwrap) and
    the directories it loads from that bwrap must show (its prefix, a venv's base prefix), outside /usr."""

    executable: str
    roots: tuple[str, ...]


_probe_lock = threading.Lock()
_interpreters: dict[str, Interpreter] = {}
_probe: dict[tuple[str, str], tuple[bool | None, str]] = {}  # (what, executable) -> (result, why not)


def interpreter(python: str | None = None) -> Interpreter:
    """The `Interpreter` of `python` (default: this one); another interpreter is asked once for its prefixes."""
    python = python or sys.executable
    with _probe_lock:
        if python not in _interpreters:
            if python == sys.executable:
                prefixes = [sys.prefix, sys.base_prefix]
            else:
                ask = "import sys; print(sys.prefix); print(sys.base_prefix)"
                # Not -S: `site` is what sets a venv's sys.prefix (without it, the venv's pyvenv.cfg and packages
                # would be left out of the view).
                out = subprocess.run([python, "-I", "-c", ask], capture_output=True, text=True, timeout=30,
                                     check=True).stdout
                prefixes = out.split("\n")[:2]
            exe = os.path.join(os.path.realpath(os.path.dirname(python)), os.path.basename(python))
            found = (*prefixes, os.path.dirname(exe), os.path.dirname(os.path.realpath(exe)))
            dirs = {os.path.realpath(d) for d in found}
            shown = [d for d in sorted(dirs) if not any(d == s or d.startswith(s + "/") for s in SYSTEM_DIRS)]
            # a directory inside another one already shown needs no bind of its own
            roots = tuple(d for d in shown if not any(d.startswith(o + "/") for o in shown if o != d))
            _interpreters[python] = Interpreter(exe, roots)
        return _interpreters[python]


def _bwrap_args(modern: bool, interp: Interpreter, host_dir: Path) -> list[str]:
    """bwrap's options: no network, IPC, UTS or PID sharing, an unprivileged user in its own user namespace, a
    read-only minimal view (the system directories, the interpreter's, a few /etc files) on a read-only root, and
    small fresh tmpfs mounts; `modern` adds what bwrap >= 0.8 offers."""
    size = ["--size", str(DISK_MB * 2**20)] if modern else []
    args = ["--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--die-with-parent", "--new-session"]
    if modern:
        args += ["--disable-userns"]  # no nested user namespace, hence no way to regain capabilities in one
    if os.geteuid() == 0:
        args += ["--cap-drop", "ALL"]
    for d in SYSTEM_DIRS:
        if os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    for f in ETC_FILES:
        if os.path.exists(f):
            args += ["--ro-bind", os.path.realpath(f), f]
    args += ["--ro-bind", str(host_dir / "passwd"), "/etc/passwd", "--ro-bind", str(host_dir / "group"), "/etc/group"]
    args += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm", *size, "--tmpfs", "/tmp",
             "--dir", WORK_DIR]
    # The interpreter's directories after the fresh mounts, wherever they live: a venv under /tmp or /dev/shm bound
    # before the tmpfs over it would vanish from the view (bwrap: execvp ...: No such file or directory).
    made = {"/", "/tmp", "/dev", "/dev/shm", WORK_DIR}
    for root in interp.roots:
        # The directories above the interpreter's (/root, /home/me, /tmp/ci, ...) exist only as its path: 0111, so
        # the code may pass through them but not list them; they are remounted read-only below (or, in /tmp, they
        # are the sandbox's own and hold nothing), so it cannot chmod them to see more.
        for parent in reversed(Path(root).parents):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0111", "--dir", str(parent)]
        args += ["--ro-bind", root, root]
    # /dev is a writable tmpfs of unbounded size: read-only from here on (its bounded /dev/shm stays writable).
    args += ["--remount-ro", "/dev",
             "--ro-bind", str(host_dir / "work" / "main.py"), f"{WORK_DIR}/main.py", "--remount-ro", "/"]
    return [*args, "--chdir", WORK_DIR]


def _host_dir(code: str, stdin: str) -> Path:
    """A fresh host temp dir: `work/main.py`, `stdin` beside the work dir (out of the code's sight), and the
    sandbox's /etc/passwd and /etc/group."""
    host_dir = Path(tempfile.mkdtemp(prefix="jaxrl_llm_sandbox_"))
    (host_dir / "work").mkdir()
    (host_dir / "work" / "main.py").write_bytes(code.encode("utf-8", errors="replace"))
    (host_dir / "stdin").write_bytes(stdin.encode("utf-8", errors="replace"))
    (host_dir / "passwd").write_text(_PASSWD)
    (host_dir / "group").write_text(_GROUP)
    return host_dir


def _run_in_view(bwrap: str, modern: bool, interp: Interpreter, host_dir: Path, argv: list[str]) -> str | None:
    """None when `argv` exits 0 inside the view bwrap makes for `interp`, else the last line of what went wrong."""
    try:
        proc = subprocess.run([bwrap, *_bwrap_args(modern, interp, host_dir), "--", *argv], capture_output=True,
                              timeout=30, env=_sandbox_env())
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap failed to start ({type(e).__name__}: {e})"
    if proc.returncode == 0:
        return None
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    return err[-1] if err else f"exit status {proc.returncode}"


def _probe_bwrap(interp: Interpreter) -> tuple[bool | None, str]:
    """`(whether bwrap's modern options work, "")`, or `(None, why bwrap cannot run this interpreter)`; tried once
    per process and interpreter. The reason tells apart a missing bwrap, a bwrap that cannot make a view at all
    (`bwrap_makes_views`), and an interpreter that the view does not show or cannot start."""
    with _probe_lock:
        key = ("bwrap", interp.executable)
        if key not in _probe:
            found: bool | None = None
            why = f"bwrap (bubblewrap) is not installed; {INSTALL_BWRAP}"
            bwrap = shutil.which("bwrap")
            host_dir = _host_dir("pass\n", "")
            try:
                errors = []
                for modern in (True, False) if bwrap is not None else ():
                    assert bwrap is not None
                    error = _run_in_view(bwrap, modern, interp, host_dir, [interp.executable, "-I", "-S", "main.py"])
                    if error is None:
                        found = modern
                        break
                    errors.append(error)
                if bwrap is not None and found is None:
                    why = _why_not(bwrap, interp, host_dir, errors[-1])
            finally:
                shutil.rmtree(host_dir, ignore_errors=True)
            _probe[key] = (found, why)
        return _probe[key]


def _true_program() -> str:
    return os.path.realpath(shutil.which("true") or "/bin/true")


def _why_not(bwrap: str, interp: Interpreter, host_dir: Path, error: str) -> str:
    """Why the interpreter does not run under bwrap, once a probe failed with `error`."""
    if not any(_run_in_view(bwrap, m, Interpreter("", ()), host_dir, [_true_program()]) is None for m in (True, False)):
        return (f"bwrap is installed but cannot make a sandbox here ({error}): the kernel or the container refuses "
                f"unprivileged user namespaces, or bwrap lacks its setuid bit")
    return (f"bwrap works here, but the interpreter {interp.executable} could not be run inside the sandbox's view "
            f"(it loads from {', '.join(interp.roots) or '/usr'}): {error}")


def bwrap_makes_views() -> tuple[bool, str]:
    """`(True, "")` when bwrap is installed and runs `true` in a minimal view of this machine (namespaces allowed),
    else `(False, why)`: the two reasons to skip, not fail, a test of the bwrap sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, "bwrap (bubblewrap) is not installed"
    host_dir = _host_dir("pass\n", "")
    try:
        errors = [_run_in_view(bwrap, m, Interpreter("", ()), host_dir, [_true_program()]) for m in (True, False)]
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
    if None in errors:
        return True, ""
    return False, f"bwrap cannot make a sandbox here: {errors[-1]}"


def bwrap_usable(python: str | None = None) -> bool:
    """Whether bubblewrap runs this interpreter here (probed once per process)."""
    return _probe_bwrap(interpreter(python))[0] is not None


_configured = ""


def use_sandbox(mode: str) -> None:
    """The mode of every later `run_python` call without its own `mode` in this process: a run's `env.sandbox`."""
    global _configured
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox mode {mode!r}: one of {', '.join(SANDBOX_MODES)}")
    _configured = mode


def sandbox_mode(mode: str | None = None) -> str:
    """The mode a call runs in: `mode`, else `use_sandbox`'s, else JAXRL_LLM_SANDBOX, else "bwrap"."""
    return mode or _configured or os.environ.get(SANDBOX_ENV, "").strip().lower() or "bwrap"


def sandbox_problem(mode: str | None = None, python: str | None = None) -> str:
    """"" when `mode` (default: `sandbox_mode()`) can run code here, else one line saying why and what to do."""
    mode = sandbox_mode(mode)
    interp = interpreter(python)
    if mode == "bwrap":
        found, why = _probe_bwrap(interp)
        return "" if found is not None else f"the code sandbox cannot run: {why}; {OPT_IN}"
    if mode != "subprocess":
        return f"sandbox mode {mode!r} ({SANDBOX_ENV} or env.sandbox): one of {', '.join(SANDBOX_MODES)}"
    if os.geteuid() == 0 and not _nobody_can_run(interp):
        return (f"the plain-subprocess sandbox, run by root, runs the code as user nobody ({NOBODY}), who cannot "
                f"start {interp.executable} (a directory on its path is closed to other users); {INSTALL_BWRAP}, or "
                f"run as a user other than root")
    return ""


_said: set[str] = set()


def _say_once(line: str) -> None:
    with _probe_lock:
        if line in _said:
            return
        _said.add(line)
    print(f"jaxrl_llm: {line}", file=sys.stderr, flush=True)


def describe_sandbox(mode: str | None = None, python: str | None = None) -> str:
    """One line for a run's log: the mode and what it isolates, or why it cannot run."""
    mode = sandbox_mode(mode)
    problem = sandbox_problem(mode, python)
    if problem:
        return problem
    if mode == "bwrap":
        return "sandboxed code runs in bubblewrap: a minimal read-only view, no network (docs/sandbox.md)"
    user = f"user nobody ({NOBODY})" if os.geteuid() == 0 else "this process's user"
    return (f"sandboxed code runs in a plain subprocess as {user} (env.sandbox: subprocess, opted in): rlimits only, "
            f"no network isolation, the files that user may read are readable (docs/sandbox.md)")


def _sandbox_env(home: str = WORK_DIR) -> dict[str, str]:
    """The sandbox's whole environment: nothing of the caller's (tokens, keys) leaks in."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # BLAS and OpenMP start a thread per core, which the process limit (threads count) would refuse.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _nobody_can_run(interp: Interpreter) -> bool:
    """Whether uid `NOBODY` can start the interpreter (not when it lives under root's 0700 home); tried once."""
    with _probe_lock:
        key = ("nobody", interp.executable)
        if key not in _probe:
            try:
                ok = subprocess.run([interp.executable, "-I", "-S", "-c", "pass"], capture_output=True, timeout=30,
                                    cwd="/", env=_sandbox_env(), user=NOBODY, group=NOBODY,
                                    extra_groups=[]).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
            _probe[key] = (ok, "")
        return bool(_probe[key][0])


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 8192,
               max_processes: int = 16, stdin: str = "", mode: str | None = None,
               python: str | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox with `stdin` as its input; never raises. `mode`: "bwrap" or
    "subprocess" (default: `sandbox_mode()`); `python`: the interpreter (default: this one)."""
    mode = sandbox_mode(mode)
    try:
        problem = sandbox_problem(mode, python)
        if problem:  # refused: no code runs outside the sandbox asked for
            _say_once(problem)
            return SandboxResult("", f"sandbox unavailable: {problem}\n", None, False, False, mode)
        if mode == "subprocess":
            _say_once(describe_sandbox(mode, python))
        return _run(code, mode, interpreter(python), max(0.01, float(timeout_s)), max(1, int(memory_mb)),
                    max(0, int(max_output_bytes)), max(1, int(max_processes)), stdin)
    except Exception as e:  # a sandbox that fails must read as a failed run to the caller, not stop it
        return SandboxResult("", f"sandbox error: {type(e).__name__}: {e}", None, False, False, mode)


def _run(code: str, mode: str, interp: Interpreter, timeout_s: float, memory_mb: int, max_output_bytes: int,
         max_processes: int, stdin: str) -> SandboxResult:
    host_dir = _host_dir(code, stdin)
    try:
        work_dir = host_dir / "work"  # the fallback's work dir
        limits = [int(timeout_s) + 1, memory_mb * 2**20, max_processes, DISK_MB * 2**20, OPEN_FILES, 0]
        inner = [interp.executable, "-I", "-S", "-c", _LAUNCHER, *map(str, limits)]
        user: int | None = None
        if mode == "bwrap":
            modern, _ = _probe_bwrap(interp)
            bwrap = shutil.which("bwrap")
            assert modern is not None and bwrap is not None
            argv, cwd = [bwrap, *_bwrap_args(modern, interp, host_dir), "--", *inner], None
            # Run by root, bwrap maps the sandbox's user to root outside, whom the kernel exempts from
            # RLIMIT_NPROC: the process count is then watched from here instead.
            watch_processes = os.geteuid() == 0
        else:
            argv, cwd = inner, work_dir
            watch_processes = False
            if os.geteuid() == 0:  # never root: `sandbox_problem` refused the mode unless nobody can run it
                user = NOBODY
                os.chown(work_dir, NOBODY, NOBODY)
                host_dir.chmod(0o711)  # mkdtemp's 0700 would bar nobody from the path to its own dir
        deadline = time.monotonic() + timeout_s
        with open(host_dir / "stdin", "rb") as stdin_file:
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                    env=_sandbox_env(WORK_DIR if mode == "bwrap" else str(work_dir)),
                                    start_new_session=True, user=user, group=user,
                                    extra_groups=[] if user is not None else None)
        watch = ProcessWatch(proc.pid, mode, max_processes) if watch_processes else None
        try:
            stdout, stderr, truncated, timed_out = collect_output(proc, deadline, max_output_bytes, watch)
        finally:
            # The whole group, not just the child: forks left behind (in bwrap, killing bwrap ends its namespace).
            kill_group(proc.pid)
            returncode = proc.wait()
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()
        if mode == "bwrap" and 128 < returncode < 128 + signal.NSIG:
            returncode = -(returncode - 128)  # bwrap reports a child killed by signal N as 128 + N
        if watch is not None and watch.exceeded:
            stderr += b"\n" if stderr and not stderr.endswith(b"\n") else b""
            stderr += f"sandbox: more than {max_processes} processes; all were killed\n".encode()
            returncode, timed_out = -signal.SIGKILL, False
        return SandboxResult(stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace"),
                             None if timed_out else returncode, timed_out, truncated, mode)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
