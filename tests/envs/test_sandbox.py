"""The Python sandbox, in both modes (bubblewrap and the plain-subprocess fallback), and the `code_tests` reward.

Every hostile case runs under limits set before its first line (short timeouts, few processes, little memory), so
no test can harm the machine that runs it, root included.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxrl_llm.envs.sandbox import (
    SANDBOX_ENV,
    SandboxResult,
    bwrap_makes_views,
    bwrap_usable,
    run_python,
    sandbox_problem,
)
from jaxrl_llm.rewards.code_execution import code_tests_reward, extract_code


def subprocess_python() -> str | None:
    """An interpreter the plain-subprocess mode can run here: this one, or (run by root, when user nobody cannot
    start this one, e.g. pyenv under root's 0700 home) the system's Python, which nobody can; None if neither."""
    for python in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if python and os.path.exists(python) and not sandbox_problem("subprocess", python):
            return python
    return None


SUBPROCESS_PYTHON = subprocess_python()


def require_bwrap(python: str | None = None) -> None:
    """Skip only where bubblewrap is absent or cannot make any view (no user namespaces); where it can, a sandbox
    that does not run this interpreter is a failure, with the probe's reason, never a skip."""
    makes_views, why = bwrap_makes_views()
    if not makes_views:
        pytest.skip(why)
    assert bwrap_usable(python), sandbox_problem("bwrap", python)


@pytest.fixture(params=["bwrap", "subprocess"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each sandbox mode in turn: bwrap (skipped where it is not usable) and the opted-in plain subprocess, chosen
    by JAXRL_LLM_SANDBOX as a library user would (no run's env.sandbox left over from another test)."""
    from jaxrl_llm.envs import sandbox

    monkeypatch.setattr(sandbox, "_configured", "")
    if request.param == "bwrap":
        require_bwrap()
        monkeypatch.delenv(SANDBOX_ENV, raising=False)
    else:
        if SUBPROCESS_PYTHON is None:
            pytest.skip("run by root, and user nobody can start no Python here: the plain subprocess refuses")
        monkeypatch.setenv(SANDBOX_ENV, "subprocess")
    return request.param


def run(mode: str, code: str, **kwargs: object) -> SandboxResult:
    python = SUBPROCESS_PYTHON if mode == "subprocess" else None
    result = run_python(textwrap.dedent(code), python=python, **kwargs)  # type: ignore[arg-type]
    assert result.mode == mode
    return result


def test_stdout_comes_back_exactly(mode: str) -> None:
    result = run(mode, "print('hello')\nprint('  wide  ')\nprint('é→✓', end='')\n")
    assert (result.stdout, result.returncode, result.timed_out, result.truncated) == ("hello\n  wide  \né→✓", 0,
                                                                                      False, False)
    assert result.observation() == "hello\n  wide  \né→✓"
    assert run(mode, "pass").observation() == "[no output]"


def test_stdin_is_passed(mode: str) -> None:
    result = run(mode, "import sys\nprint(sys.stdin.read().upper())", stdin="abc\ndef")
    assert result.stdout == "ABC\nDEF\n"


def test_environment_is_minimal(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXRL_LLM_TEST_SECRET", "hunter2")
    result = run(mode, "import os\nprint(os.environ.get('JAXRL_LLM_TEST_SECRET'), os.environ['HOME'] == os.getcwd())")
    assert result.stdout == "None True\n"


def test_work_dir_is_removed(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under /tmp, not pytest's 0700 tmp_path: the fallback run by root runs the code as nobody, who needs the path.
    parent = Path(tempfile.mkdtemp(prefix="jaxrl_llm_sandbox_test_"))
    parent.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    result = run(mode, """
        import os
        os.mkdir("sub")
        with open("sub/data.txt", "w") as f:
            f.write("x" * 1000)
        print(sorted(os.listdir(".")))
    """)
    try:
        assert result.stdout == "['main.py', 'sub']\n", result.observation()
        assert list(parent.iterdir()) == []
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_syntax_error(mode: str) -> None:
    result = run(mode, "def f(:\n")
    assert result.returncode == 1 and not result.timed_out
    assert "SyntaxError" in result.observation() and "[exit status 1]" in result.observation()


def test_infinite_loop_times_out(mode: str) -> None:
    t0 = time.monotonic()
    result = run(mode, "while True:\n    pass\n", timeout_s=1.5)
    assert result.timed_out and result.returncode is None
    assert "timed out" in result.observation()
    assert time.monotonic() - t0 < 10  # a stall of the caller, not a speed check


def test_huge_allocation_is_a_memory_error(mode: str) -> None:
    result = run(mode, "data = bytearray(10 * 2**30)\nprint('allocated')", memory_mb=256, timeout_s=5)
    assert "MemoryError" in result.observation() and "allocated" not in result.stdout
    assert result.returncode == 1


def test_huge_output_is_truncated(mode: str) -> None:
    result = run(mode, """
        import sys
        sys.stdout.write("o" * 10_000_000)
        sys.stderr.write("e" * 10_000_000 + "THE END")
    """, max_output_bytes=1000, timeout_s=10)
    assert result.truncated and result.returncode == 0 and not result.timed_out
    assert result.stdout == "o" * 1000  # the start of stdout
    assert len(result.stderr) == 1000 and result.stderr.endswith("THE END")  # the end of stderr
    assert "truncated" in result.observation()


def _marked_processes(marker: str) -> list[int]:
    """Pids whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def test_fork_bomb_is_contained(mode: str) -> None:
    # The children exec `sleep` with a unique argument, so any that outlived the sandbox would be found.
    marker = f"30.{secrets.randbelow(10**9):09d}"
    result = run(mode, f"""
        import os
        forks = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            forks += 1
        print("forks", forks, flush=True)
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, max_processes=8, timeout_s=2)
    # RLIMIT_NPROC refuses the 8th process; where the code runs as host root (whom the kernel exempts) the sandbox
    # counts the processes itself and kills them all.
    watched = "sandbox: more than 8 processes; all were killed" in result.stderr
    if not watched:
        assert result.stdout.startswith("forks ") and int(result.stdout.split()[1]) < 8, result.observation()
    assert result.timed_out or watched
    for _ in range(200):  # SIGKILL'd processes vanish within moments
        if not _marked_processes(marker):
            break
        time.sleep(0.01)
    assert _marked_processes(marker) == []


@pytest.fixture
def outside_file() -> Iterator[Path]:
    """A caller's file outside the sandbox and outside /tmp (which bwrap replaces with its own)."""
    base = Path("/var/tmp")
    if not (base.is_dir() and os.access(base, os.W_OK)):
        pytest.skip("/var/tmp is not a writable directory here")
    directory = Path(tempfile.mkdtemp(dir=base, prefix="jaxrl_llm_sandbox_test_"))
    directory.chmod(0o755)
    target = directory / "precious.txt"
    target.write_text("keep me")
    try:
        yield target
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_system_is_read_only(mode: str, outside_file: Path) -> None:
    assert run(mode, "import os\nprint(os.geteuid())").stdout != "0\n"  # never root, in either mode
    result = run(mode, f"""
        import os
        target = {str(outside_file)!r}
        try:
            print("read", open(target).read())
        except OSError as e:
            print("read refused", type(e).__name__)
        attempts = {{
            "overwrite": lambda: open(target, "w").write("gone"),
            "append": lambda: open(target, "a").write("more"),
            "delete": lambda: os.remove(target),
            "rename": lambda: os.rename(target, target + ".moved"),
            "create beside": lambda: open(os.path.join(os.path.dirname(target), "new.txt"), "w").write("x"),
            "create in /usr": lambda: open("/usr/jaxrl_llm_sandbox_probe", "w").write("x"),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print("WROTE", name)
            except OSError:
                print("refused", name)
    """)
    assert "WROTE" not in result.stdout, result.observation()
    assert result.stdout.count("refused") >= 6
    assert outside_file.read_text() == "keep me"
    assert sorted(p.name for p in outside_file.parent.iterdir()) == ["precious.txt"]
    assert not Path("/usr/jaxrl_llm_sandbox_probe").exists()
    if mode == "bwrap":
        assert "read refused FileNotFoundError" in result.stdout  # not in its view at all
    else:
        assert "read keep me" in result.stdout  # the opt-in: what user nobody may read is readable


def test_network_is_blocked_under_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only loopback, in this process: a listener the sandbox would reach if it shared the network.
    require_bwrap()
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = run("bwrap", f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
                print("connected")
            except OSError as e:
                print("blocked", type(e).__name__)
        """, timeout_s=5)
    assert result.stdout.startswith("blocked"), result.observation()




def test_observation_notes() -> None:
    killed = SandboxResult("partial\n", "Traceback ...\nMemoryError\n", -9, False, True, "bwrap")
    assert killed.observation() == ("partial\nTraceback ...\nMemoryError\n[killed by SIGKILL (a limit (CPU time or "
                                    "memory) or the sandbox); output truncated (stdout keeps its start, stderr its "
                                    "end)]")
    assert SandboxResult("", "", None, True, False, "subprocess").observation() == (
        "[timed out: killed at the wall-clock limit]")
    assert "SIGXCPU (the CPU time limit)" in SandboxResult("", "", -24, False, False, "bwrap").observation()


def test_extract_code() -> None:
    assert extract_code("Here:\n```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\ndone") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("z = 4") == "z = 4"


@pytest.fixture
def usable_sandbox(monkeypatch: pytest.MonkeyPatch) -> str:
    """A mode that runs code here, as a user would pick it: bwrap, else the opt-in (when it can run this Python)."""
    from jaxrl_llm.envs import sandbox

    monkeypatch.setattr(sandbox, "_configured", "")
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    if bwrap_makes_views()[0]:
        assert bwrap_usable(), sandbox_problem("bwrap")
        return "bwrap"
    if sandbox_problem("subprocess"):
        pytest.skip("no sandbox runs here: bubblewrap is missing, and the plain subprocess refuses this Python")
    monkeypatch.setenv(SANDBOX_ENV, "subprocess")
    return "subprocess"


def test_code_tests_reward(usable_sandbox: str) -> None:
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    completions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",
        "```python\nimport os\nos._exit(0)\n```",  # exits 0 before the tests: no reward
        "def add(a, b):\n    return a + b\nprint('x' * 100_000)",  # a pass, whatever it prints
    ]
    t0 = time.monotonic()
    rewards = code_tests_reward(["p"] * len(completions), completions, tests=[tests] * len(completions),
                                timeout_s=1.5)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - t0 < 20  # the loop is cut at its timeout, in parallel with the others


def test_code_tests_reward_needs_its_field() -> None:
    with pytest.raises(ValueError, match="'unit_tests'"):
        code_tests_reward(["p"], ["x = 1"], tests_field="unit_tests", answer=["1"])


@pytest.fixture
def caller_secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """Files the caller can read and the code must not: a 0600 file in $HOME, a file in the caller's working
    directory, and one beside a run directory (both outside /tmp, which bwrap replaces with its own)."""
    if not (Path("/var/tmp").is_dir() and os.access("/var/tmp", os.W_OK)):
        pytest.skip("/var/tmp is not a writable directory here")
    home = Path.home()
    if not (home.is_dir() and os.access(home, os.W_OK)):
        pytest.skip(f"the home directory {home} is not writable here")
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="jaxrl_llm_sandbox_test_"))
    work.chmod(0o755)
    (work / "runs" / "my_run").mkdir(parents=True)
    found = {"home": home / f".jaxrl_llm_sandbox_test_{secrets.token_hex(4)}", "cwd": work / ".env",
             "beside_run": work / "runs" / "hf_token"}
    for path in found.values():
        path.write_text("SECRET")
    found["home"].chmod(0o600)
    monkeypatch.chdir(work)
    try:
        yield found
    finally:
        found["home"].unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)


def test_bwrap_shows_the_code_a_minimal_view(caller_secrets: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    require_bwrap()
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    prefix = os.path.realpath(sys.prefix)
    reads = ["/etc/shadow", "/etc/hostname", *map(str, caller_secrets.values())]
    lists = ["/root", "/home", os.path.dirname(prefix), str(caller_secrets["cwd"].parent), "/var", "/sys"]
    writes = ["/x", "/etc/x", "/usr/x", "/root/x", f"{prefix}/x", "/var/x", "/proc/x", "/dev/x"]
    result = run("bwrap", f"""
        import json, os
        seen = {{}}
        for path in {reads!r}:
            try:
                seen[path] = open(path).read()
            except OSError as e:
                seen[path] = type(e).__name__
        for path in {lists!r}:
            try:
                seen[path] = os.listdir(path)
            except OSError as e:
                seen[path] = type(e).__name__
        for path in {writes!r}:
            try:
                open(path, "w").write("x")
                seen[path] = "WROTE"
            except OSError as e:
                seen[path] = type(e).__name__
        try:
            os.chmod("/root", 0o755)
            seen["chmod /root"] = "CHANGED"
        except OSError as e:
            seen["chmod /root"] = type(e).__name__
        open("scratch.txt", "w").write("mine")  # the work dir is the code's own
        open("/tmp/other.txt", "w").write("mine")
        seen["work dir"] = sorted(os.listdir("."))
        seen["/"] = sorted(os.listdir("/"))
        print(json.dumps(seen))
    """)
    seen = json.loads(result.stdout)
    assert "SECRET" not in result.stdout, seen
    for path in reads:
        assert seen[path] == "FileNotFoundError", (path, seen[path])  # not hidden: absent
    for path in lists:
        assert seen[path] in ("PermissionError", "FileNotFoundError"), (path, seen[path])
    for path in writes:
        assert seen[path] in ("OSError", "PermissionError", "FileNotFoundError"), (path, seen[path])
    assert seen["chmod /root"] == "OSError"  # a read-only root: the closed directories stay closed
    assert seen["work dir"] == ["main.py", "scratch.txt"]
    assert set(seen["/"]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root", "sbin", "tmp",
                              "usr", *Path(prefix).parts[1:2]}
    assert all(path.read_text() == "SECRET" for path in caller_secrets.values())


def test_the_standard_library_and_installed_packages_work_under_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    require_bwrap()
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    result = run("bwrap", """
        import collections, datetime, decimal, fractions, getpass, hashlib, itertools, json, math, random, re
        import sqlite3, statistics, subprocess, tempfile, time
        from multiprocessing import Pool
        import numpy as np

        db = sqlite3.connect(":memory:")
        db.execute("create table t (x)")
        db.executemany("insert into t values (?)", [(i,) for i in range(10)])
        with tempfile.NamedTemporaryFile("w") as f:
            f.write("x")
        with Pool(2) as pool:
            squares = pool.map(abs, [-1, -2, -3])
        print(json.dumps({
            "math": math.comb(10, 3), "fraction": str(fractions.Fraction(1, 3) + fractions.Fraction(1, 6)),
            "decimal": str(decimal.Decimal("0.1") + decimal.Decimal("0.2")),
            "sql": db.execute("select sum(x) from t").fetchone()[0],
            "stats": statistics.mean([1, 2, 3, 4]), "sha": hashlib.sha256(b"a").hexdigest()[:8],
            "regex": re.findall(r"\\d+", "a1b22"), "counter": collections.Counter("aab")["a"],
            "pool": squares, "user": getpass.getuser(), "year": datetime.date(2026, 1, 1).year,
            "zone": time.localtime().tm_zone is not None, "numpy": int(np.arange(5).sum()),
            "echo": subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout,
            "perm": len(list(itertools.permutations(range(4)))), "random": 0 <= random.random() < 1,
        }))
    """, timeout_s=20)
    assert result.returncode == 0, result.observation()
    assert json.loads(result.stdout) == {
        "math": 120, "fraction": "1/2", "decimal": "0.3", "sql": 45, "stats": 2.5, "sha": "ca978112",
        "regex": ["1", "22"], "counter": 2, "pool": [1, 2, 3], "user": "nobody", "year": 2026, "zone": True,
        "numpy": 10, "echo": "hi\n", "perm": 24, "random": True}


def test_without_bwrap_nothing_runs_and_one_line_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    from jaxrl_llm.config import ConfigError, load_run_config
    from jaxrl_llm.envs import sandbox
    from jaxrl_llm.preflight import check_sandbox

    monkeypatch.setattr(sandbox, "_probe", {})  # probed again, with no bwrap on PATH
    monkeypatch.setattr(sandbox, "_configured", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    marker = tmp_path / "ran"
    result = run_python(f"open({str(marker)!r}, 'w').write('x')")
    assert (result.mode, result.returncode, result.stdout) == ("bwrap", None, "")
    assert not marker.exists()  # refused: the code never ran, in no other mode either
    problem = sandbox_problem()
    assert "\n" not in problem and "apt-get install bubblewrap" in problem and "env.sandbox: subprocess" in problem
    assert result.stderr == f"sandbox unavailable: {problem}\n" and problem in result.observation()
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        code_tests_reward(["p"], ["x = 1"], tests=["assert x == 1"])
    config = load_run_config(None, ["env.name=tool_use", "env.tools=[calculator,python]"])
    with pytest.raises(ConfigError, match=r"^the python tool \(env.tools\) run model code, and env.sandbox=bwrap "
                                          r"cannot here: the code sandbox cannot run: bwrap \(bubblewrap\) is not "
                                          r"installed; .*apt-get install") as e:
        check_sandbox(config)
    assert "\n" not in str(e.value)
    check_sandbox(load_run_config(None, ["env.name=tool_use", "env.tools=[calculator]"]))  # no code to run: fine


def test_the_subprocess_opt_in_says_so_and_never_runs_as_root(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_llm.envs import sandbox

    monkeypatch.setattr(sandbox, "_said", set())
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    if os.geteuid() == 0 and sandbox_problem("subprocess"):  # this interpreter is closed to nobody: refused
        refused = run_python("print(1)", mode="subprocess")
        assert refused.returncode is None and "runs the code as user nobody (65534), who cannot start" in \
            refused.stderr and "apt-get install bubblewrap" in refused.stderr
    if SUBPROCESS_PYTHON is None:
        pytest.skip("run by root, and user nobody can start no Python here: the plain subprocess refuses")
    result = run_python("import os\nprint(os.geteuid())", mode="subprocess", python=SUBPROCESS_PYTHON)
    assert result.mode == "subprocess" and result.returncode == 0
    assert int(result.stdout) == (sandbox.NOBODY if os.geteuid() == 0 else os.geteuid())
    said = capsys.readouterr().err
    assert "sandboxed code runs in a plain subprocess" in said and "opted in" in said
    assert "no network isolation" in sandbox.describe_sandbox("subprocess", SUBPROCESS_PYTHON)


def _scratch_dirs() -> list[str]:
    """Where CI jobs and throwaway environments put a Python: below /tmp, and /dev/shm where it is writable."""
    return ["/tmp", *(["/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else [])]


def lend_site_packages(venv_dir: Path) -> None:
    """Make this interpreter's packages importable in the venv at `venv_dir`, however they were installed.
    `system_site_packages` would lend the *base* interpreter's (not this venv's, when the suite runs in one), and
    a path in a `.pth` file would miss an editable install of setuptools' import-hook kind, whose finder is
    installed by a `.pth` line of its own; `site.addsitedir` adds each directory and runs its `.pth` files, as
    this interpreter's start-up did."""
    import site

    dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (site_packages,) = venv_dir.glob("lib/python*/site-packages")
    (site_packages / "_lent_by_the_test_suite.pth").write_text(
        f"import site; list(map(site.addsitedir, {[d for d in dirs if os.path.isdir(d)]!r}))\n")


@pytest.fixture(params=[(where, copies) for where in _scratch_dirs() for copies in (False, True)],
                ids=lambda p: f"{p[0]}-{'copies' if p[1] else 'links'}")
def scratch_venv(request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    """`(venv python, a secret beside the venv)`: a virtual environment made in a fresh directory below /tmp (or
    /dev/shm), its interpreter linked to this one or copied (`--copies`), seeing this one's packages."""
    import venv

    where, copies = request.param
    base = Path(tempfile.mkdtemp(dir=where, prefix="jaxrl_llm_sandbox_venv_"))
    try:
        venv.EnvBuilder(symlinks=not copies, with_pip=False).create(base / "venv")
        lend_site_packages(base / "venv")
        secret = base / "beside_the_venv.txt"
        secret.write_text("SECRET")
        yield base / "venv" / "bin" / "python", secret
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_bwrap_runs_an_interpreter_that_lives_under_tmp(scratch_venv: tuple[Path, Path],
                                                        caller_secrets: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox's own /tmp (and /dev/shm) are fresh tmpfs mounts; an interpreter whose prefix lives there is
    bound after them, so it still runs, with its standard library, and the view still shows nothing else."""
    python, secret = scratch_venv
    require_bwrap(str(python))
    monkeypatch.delenv(SANDBOX_ENV, raising=False)
    reads = ["/etc/shadow", str(secret), *map(str, caller_secrets.values())]
    result = run_python(textwrap.dedent(f"""
        import json, sys, decimal, sqlite3, ctypes, hashlib, zlib
        seen = {{"prefix": sys.prefix, "sum": str(decimal.Decimal("0.1") + decimal.Decimal("0.2")),
                 "sqlite": sqlite3.connect(":memory:").execute("select 6 * 7").fetchone()[0],
                 "sha": hashlib.sha256(zlib.compress(b"x")).hexdigest()[:8]}}
        for path in {reads!r}:
            try:
                seen[path] = open(path).read()
            except OSError as e:
                seen[path] = type(e).__name__
        print(json.dumps(seen))
    """), python=str(python))
    assert result.mode == "bwrap" and result.returncode == 0, result.observation()
    seen = json.loads(result.stdout)
    assert seen["prefix"] == str(python.parent.parent) and seen["sum"] == "0.3" and seen["sqlite"] == 42
    assert seen["sha"] == __import__("hashlib").sha256(__import__("zlib").compress(b"x")).hexdigest()[:8]
    for path in reads:
        assert seen[path] == "FileNotFoundError", (path, seen[path])
    assert "SECRET" not in result.stdout

    # The user's own view of it: the venv's Python asks the library whether its sandbox runs, and runs code.
    probe = ("from jaxrl_llm.envs.sandbox import bwrap_usable, run_python, sandbox_problem\n"
             "print(bwrap_usable(), sandbox_problem('bwrap') or '-', run_python('print(6 * 7)').stdout.strip())")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tempfile.gettempdir())
    assert out.returncode == 0 and out.stdout.split() == ["True", "-", "42"], out.stderr[-2000:]


def test_the_probe_says_the_interpreter_is_not_in_the_view(scratch_venv: tuple[Path, Path]) -> None:
    """bwrap installed and working, the interpreter absent from the view: the reason names the interpreter and
    where it lives, and does not suggest installing bubblewrap."""
    from jaxrl_llm.envs import sandbox

    python, _ = scratch_venv
    require_bwrap()
    hidden = sandbox.Interpreter(str(python), ())  # as if its prefix had not been bound
    found, why = sandbox._probe_bwrap(hidden)
    assert found is None
    assert why.startswith(f"bwrap works here, but the interpreter {python} could not be run inside the sandbox's "
                          "view") and "No such file or directory" in why and "install" not in why
