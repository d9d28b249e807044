"""The Python sandbox, in both modes (bubblewrap and the plain-subprocess fallback), and the `code_tests` reward.

Every hostile case runs under limits set before its first line (short timeouts, few processes, little memory), so
no test can harm the machine that runs it, root included.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxrl_llm.envs.sandbox import SANDBOX_ENV, SandboxResult, bwrap_usable, run_python
from jaxrl_llm.rewards.code_execution import code_tests_reward, extract_code


@pytest.fixture(params=["bwrap", "subprocess"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each sandbox mode in turn: bwrap (skipped where it is not usable) and the forced fallback."""
    if request.param == "bwrap":
        if not bwrap_usable():
            pytest.skip("bubblewrap (bwrap) is not installed or not usable here")
        monkeypatch.delenv(SANDBOX_ENV, raising=False)
    else:
        monkeypatch.setenv(SANDBOX_ENV, "subprocess")
    return request.param


def run(mode: str, code: str, **kwargs: object) -> SandboxResult:
    result = run_python(textwrap.dedent(code), **kwargs)  # type: ignore[arg-type]
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
    if mode == "subprocess" and run(mode, "import os\nprint(os.geteuid())").stdout == "0\n":
        pytest.skip("the fallback runs the code as root here (nobody cannot start this interpreter): only file "
                    "permissions would protect the caller's files, and root passes them")
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
        assert "read keep me" in result.stdout  # a read-only view: world-readable files stay readable


def test_network_is_blocked_under_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only loopback, in this process: a listener the sandbox would reach if it shared the network.
    if not bwrap_usable():
        pytest.skip("bubblewrap (bwrap) is not installed or not usable here")
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


def test_fallback_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SANDBOX_ENV, "subprocess")
    assert run_python("print(1)").mode == "subprocess"


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


def test_code_tests_reward() -> None:
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
