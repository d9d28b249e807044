"""Run safety as a user meets it through `train.py`: one clear line (and the right exit code) for every bad
input, no file outside the run's out_dir touched; a refused second run, an explicit overwrite, a checked
resume; crash and corrupt-checkpoint recovery with exactly one metrics row per step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import train
from jaxrl_llm.cli.errors import run_command
from tests.runs import ROOT, read_rows, read_samples, tiny_run_args

pytestmark = pytest.mark.heavy(seconds=34)

VOLATILE = ("time/", "tokens_per_second")  # wall-clock metrics: the only ones a rerun may change


# ------------------------------------------------------------------------------------ reward functions


def returns_dict(prompts, completions, **_):
    return {"score": [1.0] * len(completions)}


def returns_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def returns_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


def returns_strings(prompts, completions, **_):
    return ["1"] * len(completions)


def raises(prompts, completions, **_):
    raise KeyError("answer_text")


def slow_exact(prompts, completions, **fields):
    """The default exact-answer reward, 2 s late: keeps a run busy while a second one tries its out_dir."""
    from jaxrl_llm.rewards import math_answer_reward

    time.sleep(2.0)
    return math_answer_reward(prompts, completions, **fields)


def hangs(prompts, completions, **_):
    time.sleep(60)
    return [0.0] * len(completions)


# ------------------------------------------------------------------------------------ helpers


def _base(task: Path, out: Path) -> list[str]:
    # 2 prompts x 2 samples: the messages and counts below name these values
    return tiny_run_args(out, "rl.prompts_per_step=2", "rl.group_size=2", task=task)


def _snapshot(*roots: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `roots` except `skip` (the run's out_dir) and caches."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__", ".pytest_cache", ".hypothesis",
                                                            ".ruff_cache")
                           and not Path(dirpath, d).resolve().is_relative_to(skip.resolve())]
            for name in filenames:
                path = Path(dirpath, name)
                st = path.stat()
                out[str(path)] = (st.st_size, st.st_mtime_ns)
    return out


def _run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = train.cli(argv)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def bad_inputs(tiny_task, tmp_path_factory):
    """Broken copies of the tiny task's files, made once."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = {
        "malformed.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n',
        "not_object.jsonl": '{"prompt": "1+1=", "answer": "2"}\n[1, 2]\n',
        "empty.jsonl": "\n\n",
        "no_prompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n',
        "wrong_type.jsonl": '{"prompt": 12, "answer": "2"}\n',
        "bad_yaml.yaml": "rl:\n  beta: [1\n",
        "typo.yaml": "rl:\n  betta: 0.1\n",
        "zero_mu.yaml": "rl:\n  mu: 0\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    (root / "a_directory.jsonl").mkdir()
    (root / "out_file").write_text("not a directory")
    for name, drop in (("no_config", ["config.json"]), ("no_tokenizer", ["tokenizer.json", "tokenizer_config.json",
                                                                        "special_tokens_map.json"])):
        shutil.copytree(tiny_task / "model", root / name)
        for f in drop:
            (root / name / f).unlink(missing_ok=True)
    shutil.copytree(tiny_task / "model", root / "gpt2")
    cfg = json.loads((root / "gpt2" / "config.json").read_text())
    (root / "gpt2" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2",
                                                            "architectures": ["GPT2LMHeadModel"]}))
    return root


def _reward(fn: str, extra: str = "") -> str:
    return f"rewards=[{{name: 'tests.run.test_reliability:{fn}'{extra}}}]"


# (id, extra argv (B = the bad-input dir, T = the tiny task), exit code, substrings of the one-line message)
CASES = [
    # --- config values from the command line
    ("typo_key", ["rl.betta=0.1"], 2, ["rl.betta", "command line", "Did you mean: 'beta'"]),
    ("not_a_number", ["rl.beta=abc"], 2, ["rl.beta", "command line", "could not be converted"]),
    ("negative_steps", ["steps=-1"], 2, ["steps=-1 must be >= 0", "command line"]),
    ("zero_prompts", ["rl.prompts_per_step=0"], 2, ["rl.prompts_per_step=0 must be >= 1"]),
    ("zero_group", ["rl.group_size=0"], 2, ["rl.group_size=0 must be >= 1"]),
    ("group_of_one", ["rl.group_size=1"], 2, ["rl.group_size=1", "at least 2 samples"]),
    # the estimator decides, whatever --algo names it: RLOO's leave-one-out baseline under --algo reinforce_pp
    ("group_of_one_rloo", ["--algo", "reinforce_pp", "rl.estimator=rloo", "rl.group_size=1"], 2,
     ["rl.group_size=1", "at least 2 samples"]),
    ("zero_grad_accum", ["rl.grad_accum=0"], 2, ["rl.grad_accum=0 must be >= 1"]),
    ("grad_accum_not_dividing", ["rl.grad_accum=3"], 2, ["rl.grad_accum=3 must divide"]),
    ("zero_mu", ["rl.mu=0"], 2, ["rl.mu=0 must be >= 1"]),
    ("negative_minibatch", ["rl.minibatch_size=-4"], 2, ["rl.minibatch_size=-4 must be >= 0"]),
    ("minibatch_not_dividing", ["rl.minibatch_size=3"], 2, ["rl.minibatch_size=3 must divide the rollout"]),
    ("zero_log_every", ["log_every=0"], 2, ["log_every=0 must be >= 1"]),
    ("zero_eval_batch", ["eval_batch_size=0"], 2, ["eval_batch_size=0 must be >= 1"]),
    ("negative_sample_every", ["sample_every=-1"], 2, ["sample_every=-1 must be >= 0"]),
    ("negative_checkpoint_every", ["checkpoint_every=-5"], 2, ["checkpoint_every=-5 must be >= 0"]),
    ("zero_keep", ["keep_checkpoints=0"], 2, ["keep_checkpoints=0 must be >= 1"]),
    ("negative_eval_size", ["eval_size=-1"], 2, ["eval_size=-1 must be >= 0"]),
    ("zero_lr", ["optim.learning_rate=0"], 2, ["optim.learning_rate=0.0 must be > 0"]),
    ("negative_lr", ["optim.learning_rate=-1e-3"], 2, ["optim.learning_rate=-0.001 must be > 0"]),
    ("beta2_one", ["optim.beta2=1.0"], 2, ["optim.beta2=1.0 must be >= 0 and < 1"]),
    ("zero_temperature", ["sampling.temperature=0"], 2, ["sampling.temperature=0.0 must be > 0"]),
    ("nan_temperature", ["sampling.temperature=nan"], 2, ["sampling.temperature=nan must be a finite number"]),
    ("top_p_above_one", ["sampling.top_p=1.5"], 2, ["sampling.top_p=1.5 must be > 0 and <= 1"]),
    ("zero_new_tokens", ["sampling.max_new_tokens=0"], 2, ["sampling.max_new_tokens=0 must be >= 1"]),
    ("negative_seed", ["seed=-1"], 2, ["seed=-1 must be >= 0"]),
    ("bad_choice", ["rl.loss.aggregation=mean"], 2, ["rl.loss.aggregation='mean'", "token-mean"]),
    ("bad_dtype", ["model.dtype=float16"], 2, ["model.dtype='float16'", "bfloat16"]),
    ("bad_on_divergence", ["monitor.on_divergence=ignore"], 2, ["monitor.on_divergence='ignore'", "stop, warn"]),
    ("negative_timeout", [_reward("raises", ", timeout_s: -1")], 2, ["rewards.0.timeout_s=-1.0 must be >= 0"]),
    ("mesh_vs_devices", ["mesh.data=3"], 2, ["mesh.data=3", "3 devices", "1 are available",
                                             "command line"]),
    ("override_without_value", ["steps"], 2, ["override 'steps' must be key=value"]),
    # --- config files
    ("yaml_missing", ["--config", "B/missing.yaml"], 2, ["missing.yaml does not exist"]),
    ("yaml_syntax", ["--config", "B/bad_yaml.yaml"], 2, ["bad_yaml.yaml is not valid YAML", "line 2"]),
    ("yaml_typo", ["--config", "B/typo.yaml"], 2, ["rl.betta", "typo.yaml", "Did you mean: 'beta'"]),
    ("yaml_bad_value", ["--config", "B/zero_mu.yaml"], 2, ["rl.mu=0 must be >= 1", "set in", "zero_mu.yaml"]),
    # --- command line
    ("unknown_algo", ["--algo", "a2c"], 2, ["argument --algo: invalid choice: 'a2c'"]),
    ("unknown_flag", ["--fast"], 2, ["unrecognized arguments: --fast"]),
    ("resume_and_overwrite", ["--resume", "--overwrite"], 2, ["--resume and --overwrite exclude each other"]),
    ("resume_without_run", ["--resume"], 2, ["--resume", "no checkpoints to resume from"]),
    # --- data
    ("data_missing", ["data.train=B/none.jsonl"], 2, ["data.train=", "none.jsonl", "missing", "command line"]),
    ("data_is_directory", ["data.train=B/a_directory.jsonl"], 2, ["a_directory.jsonl", "a directory"]),
    ("data_malformed", ["data.train=B/malformed.jsonl"], 2, ["malformed.jsonl:2: invalid JSON"]),
    ("data_not_object", ["data.train=B/not_object.jsonl"], 2, ["not_object.jsonl:2: expected a JSON object"]),
    ("data_not_utf8", ["data.train=B/latin1.jsonl"], 2, ["latin1.jsonl:2: not UTF-8"]),
    ("data_empty", ["data.train=B/empty.jsonl"], 2, ["empty.jsonl: the file has no records"]),
    ("data_no_prompt_field", ["data.train=B/no_prompt.jsonl"], 2, ["no_prompt.jsonl:2: no 'prompt' field"]),
    ("data_prompt_type", ["data.train=B/wrong_type.jsonl"], 2, ["wrong_type.jsonl:1", "must be text or chat"]),
    ("data_prompts_too_long", ["data.max_prompt_tokens=1"], 2, ["no prompt fits data.max_prompt_tokens=1"]),
    # --- model
    ("model_missing", ["model.path=B/nowhere"], 2, ["model.path=", "not found", "relative to its folder"]),
    # a path with one "/" could be a hub id: looked up once, failing at once without a network
    ("model_missing_or_hub_offline", ["model.path=nowhere/model"], 2,
     ["model.path=nowhere/model", "not a local directory", "as a hub id"]),
    ("model_path_unset", ["model.path="], 2, ["algo=grpo needs model.path", "--print-config"]),
    ("no_rewards", ["rewards=[]"], 2, ["needs rewards"]),
    ("eval_without_reward", ["rewards=[]", "algo=sft"], 2, ["data.eval=", "needs a reward"]),
    # DPO's data.eval holds pairs; its held-out prompts are dpo.eval_prompts (asked of the class, not the name)
    ("dpo_eval_prompts_without_reward", ["--algo", "dpo", "rewards=[]", "dpo.eval_prompts=T/test.jsonl"], 2,
     ["dpo.eval_prompts=", "needs a reward to score the held-out answers"]),
    ("model_no_config", ["model.path=B/no_config"], 2, ["config.json is missing"]),
    ("model_no_tokenizer", ["model.path=B/no_tokenizer"], 2, ["has no tokenizer files"]),
    ("model_unsupported", ["model.path=B/gpt2"], 2, ["unsupported model_type 'gpt2'", "supported model types"]),
    # --- rewards
    ("reward_unknown", ["rewards=[{name: exact}]"], 2, ["unknown reward function 'exact'", "math_answer"]),
    ("reward_import", ["rewards=[{name: 'no_such_module:fn'}]"], 2, ["'no_such_module:fn' cannot be imported"]),
    ("reward_dict", ["data.eval=", _reward("returns_dict")], 1,
     ["'tests.run.test_reliability:returns_dict' returned a dict"]),
    ("reward_length", ["data.eval=", _reward("returns_short")], 1, ["returns_short' returned 3 rewards for 4"]),
    ("reward_nan", ["data.eval=", _reward("returns_nan")], 1, ["returns_nan' returned a non-finite reward"]),
    ("reward_raises", ["data.eval=", _reward("raises")], 1, ["raises' raised KeyError", "answer_text"]),
    ("reward_hangs", ["data.eval=", _reward("hangs", ", timeout_s: 0.5")], 1,
     ["hangs' did not return within rewards[].timeout_s=0.5 s"]),
    ("eval_reward_strings", ["eval_reward=tests.run.test_reliability:returns_strings"], 1,
     ["returns_strings' returned '1' (str)", "real numbers"]),
    # --- file system
    ("out_dir_is_file", ["out_dir=B/out_file"], 2, ["out_file is a file, not a directory"]),
    ("export_over_input", ["export=true", "export_dir=T/model"], 2, ["is the run's input model.path"]),
    ("export_dir_not_empty", ["export=true", "export_dir=B/gpt2"], 2, ["export_dir=", "already holds files"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line(case, tiny_task, bad_inputs, tmp_path, capsys, monkeypatch):
    name, extra, code, parts = case
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    sub = [a.replace("B/", f"{bad_inputs}/").replace("T/", f"{tiny_task}/") for a in extra]
    before = _snapshot(ROOT, tiny_task, bad_inputs, skip=out)
    got, err = _run_cli(["--config", str(ROOT / "configs" / "grpo_arithmetic.yaml"), *_base(tiny_task, out), *sub]
                        if "--config" not in sub else [*sub, *_base(tiny_task, out)], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("train.py: error: ")
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert got == code, lines[0]
    assert _snapshot(ROOT, tiny_task, bad_inputs, skip=out) == before


def test_debug_shows_the_traceback(tiny_task, tmp_path, capsys):
    with pytest.raises(Exception, match="rl.grad_accum=0"):
        train.cli(["--debug", *_base(tiny_task, tmp_path / "run"), "rl.grad_accum=0"])


def test_unexpected_errors_are_one_line_too(capsys):
    def broken(argv):
        raise ZeroDivisionError("division by zero")

    assert run_command("prog", broken, []) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("prog: error: internal error ZeroDivisionError: division by zero (rerun with --debug for the "
                   "traceback, and please report it)")


def test_python_m_commands_report_one_line(tmp_path):
    """`python -m jaxrl_llm <command>` (the one entry point) and the module tools share the boundary (checked in
    subprocesses); an unknown or missing command is one line too, naming the commands."""
    cases = [
        (["-m", "jaxrl_llm", "evaluate"], 2,
         "python -m jaxrl_llm: unknown command 'evaluate'; expected one of eval, compare, report, export, generate"),
        (["-m", "jaxrl_llm", "generate", "--model", str(tmp_path / "none"), "--prompt", "hi"], 2,
         "python -m jaxrl_llm generate: error: model directory"),
        (["-m", "jaxrl_llm", "plan", "--model", str(ROOT / "models" / "arith-base"), "--batch", "0"], 2,
         "python -m jaxrl_llm plan: error: batch, group_size"),
        (["-m", "jaxrl_llm", "plan"], 2, "python -m jaxrl_llm plan: error: no model to plan"),
        (["-m", "jaxrl_llm", "data", "arithmetic", "--train", "0", "--out", str(tmp_path / "d")], 2,
         "python -m jaxrl_llm data: error: --train 0 must be >= 1"),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for argv, code, start in cases:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        assert proc.stderr.strip().startswith(start), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------ out_dir ownership


def test_a_finished_run_is_not_overwritten_unless_asked(tiny_task, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run_cli([*_base(tiny_task, out), "export=true", "checkpoint_every=1"], capsys)[0] == 0
    first = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = _run_cli([*_base(tiny_task, out), "export=true", "seed=1"], capsys)
    assert code == 2 and f"{out} holds another run" in err and "--resume" in err and "--overwrite" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == first  # nothing touched
    code, err = _run_cli([*_base(tiny_task, out), "export=true", "seed=1", "--overwrite"], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_rows(out)] == [0, 1]  # the old run's rows are gone, not appended to
    assert sorted(p.name for p in (out / "configs").iterdir()) == ["001-start.yaml"]
    assert "seed: 1" in (out / "config.yaml").read_text()


def test_resume_checks_the_config(tiny_task, tmp_path, capsys):
    out = tmp_path / "run"
    base = [*_base(tiny_task, out), "checkpoint_every=1", "data.eval="]
    assert _run_cli(base, capsys)[0] == 0
    code, err = _run_cli([*base, "--resume", "steps=2", "optim.learning_rate=1e-3", "rl.group_size=4"], capsys)
    assert code == 2
    assert "rl.group_size: 2 -> 4" in err and "optim.learning_rate: 0.0001 -> 0.001" in err
    assert "--allow-config-change" in err
    assert len(list((out / "configs").iterdir())) == 1  # the refused start left no config behind
    code, err = _run_cli([*base, "--resume", "steps=2", "log_every=2"], capsys)  # safe: proceeds with a notice
    assert code == 0 and "resuming with changed log_every: 1 -> 2, steps: 1 -> 2" in err
    code, err = _run_cli([*base, "--resume", "steps=3", "optim.learning_rate=2e-4", "--allow-config-change"],
                         capsys)
    assert code == 0 and "--allow-config-change: resuming with optim.learning_rate" in err
    kept = sorted(p.name for p in (out / "configs").iterdir())
    assert kept == ["001-start.yaml", "002-resume.yaml", "003-resume.yaml"]
    assert "learning_rate: 0.0001" in (out / "configs" / "001-start.yaml").read_text()
    assert "learning_rate: 0.0002" in (out / "configs" / "003-resume.yaml").read_text()
    assert "steps: 1" in (out / "config.yaml").read_text()  # the first start's config, never rewritten
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3]


def test_a_second_run_into_a_running_out_dir_is_refused(tiny_task, tmp_path):
    """Two real processes: the second exits 2 naming the first's PID; the first finishes normally."""
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "tests")}  # for the test's reward
    argv = [sys.executable, "train.py", *_base(tiny_task, out), "steps=3", "data.eval=", _reward("slow_exact")]
    first = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / ".lock").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.1)
    second = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert second.returncode == 2
    assert f"is in use by another run (PID {first.pid} on {socket.gethostname()}" in second.stderr
    assert "Traceback" not in second.stderr
    assert not (out / ".lock").exists()  # released at the end
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3]


def test_a_stale_lock_is_taken_over(tiny_task, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "earlier"}))
    code, err = _run_cli([*_base(tiny_task, out), "data.eval="], capsys)
    assert code == 0 and f"taking over the stale lock {out / '.lock'} (PID {dead.pid}" in err


# ------------------------------------------------------------------------------------ crashes and damage


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _tensorboard_steps(out: Path) -> dict[str, list[int]]:
    """Steps logged per scalar tag in the TensorBoard event files (TFRecord framing, tensorboardX protos)."""
    from tensorboardX.proto import event_pb2

    steps: dict[str, list[int]] = {}
    for path in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    return steps


def _crash_args(task: Path, out: Path) -> list[str]:
    return [*_base(task, out), "steps=4", "checkpoint_every=2", "keep_checkpoints=3", "tensorboard=true",
            "sample_every=1"]


@pytest.fixture(scope="module")
def reference_run(tiny_task, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    assert train.cli(_crash_args(tiny_task, out)) == 0
    return out


_KILL_IN_SAVE = textwrap.dedent("""
    import os, signal, sys
    import jaxrl_llm.run.checkpoint as ck
    import train

    original = ck.Checkpointer.save

    def save(self, step, state, meta):
        original(self, step, state, meta)  # the asynchronous write has started
        if step == int(os.environ["KILL_AT_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)

    ck.Checkpointer.save = save
    sys.exit(train.cli(sys.argv[1:]))
""")


@pytest.mark.parametrize("when", ["during_a_step", "during_a_checkpoint_write"])
def test_kill_9_then_resume_gives_identical_metrics(when, tiny_task, reference_run, tmp_path, capsys):
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "KILL_AT_STEP": "4"}
    args = _crash_args(tiny_task, out)
    if when == "during_a_step":
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:  # killed once step 3 is logged: inside step 4
            written = (out / "checkpoints" / "2").is_dir()  # finished (orbax renames it when complete)
            if written and (out / "metrics.jsonl").exists() and any(r["step"] == 3 for r in read_rows(out)):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    else:
        proc = subprocess.run([sys.executable, "-c", _KILL_IN_SAVE, *args], cwd=ROOT, env=env, capture_output=True,
                              timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert (out / ".lock").exists()  # the killed run could not release it: the resume finds it stale
    code, err = _run_cli([*args, "--resume"], capsys)
    assert code == 0, err
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # one row per step, none replayed twice
    assert _stable(rows) == _stable(read_rows(reference_run))
    tb = _tensorboard_steps(out)
    assert tb["reward/mean"] == [1, 2, 3, 4] and tb["eval/accuracy"] == [0, 4]
    samples = [s["step"] for s in read_samples(out)]
    assert samples == sorted(samples) and len(samples) == 4 * 4  # 4 completions per step, once each


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous(tiny_task, reference_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    damaged = [p for p in (out / "checkpoints" / "4").rglob("*") if p.is_file() and p.stat().st_size > 64]
    for p in damaged:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    code, err = _run_cli([*_crash_args(tiny_task, out), "--resume"], capsys)
    assert code == 0, err
    assert f"checkpoint {out / 'checkpoints' / '4'} cannot be read" in err and "falling back" in err
    assert (out / "corrupt_checkpoints" / "4").is_dir()  # kept aside, not deleted
    assert f"resumed from the checkpoint of step 2 in {out / 'checkpoints'}" in err
    assert _stable(read_rows(out)) == _stable(read_rows(reference_run))  # steps 3-4 replayed from checkpoint 2
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------------------------------ SFT and RM resume


def _sft_rm_args(algo: str, task: Path, out: Path, pairs: Path) -> list[str]:
    common = tiny_run_args(out, "sft.batch_size=8", "checkpoint_every=2", "optim.learning_rate=3e-3",
                           "optim.schedule=constant", "eval_every=0", "log_every=1")
    if algo == "sft":
        return ["--algo", "sft", *common, f"data.train={task / 'train.jsonl'}", f"data.eval={task / 'test.jsonl'}",
                "eval_size=8", "eval_batch_size=8", "sft.eval_batch_size=8", "data.answer_field=answer",
                f"model.tokenizer={task / 'tok'}"]
    return ["--algo", "rm", *common, f"model.path={task / 'model'}", f"data.train={pairs / 'train.jsonl'}",
            f"data.eval={pairs / 'test.jsonl'}", "eval_size=16", "sft.eval_batch_size=16"]


@pytest.mark.parametrize("algo", ["sft", "rm"])
def test_sft_and_reward_model_runs_resume_exactly(algo, tiny_task, tmp_path, capsys, monkeypatch):
    """4 steps straight vs 2 steps, then --resume to 4: the same rows (one per step) and the same final score."""
    from jaxrl_llm.tasks.arithmetic import make_preferences, make_problems

    monkeypatch.chdir(ROOT)
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    rows = make_preferences(make_problems(80, seed=1, max_digits=2), seed=2)
    for name, part in (("train", rows[:64]), ("test", rows[64:])):
        (pairs / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.cli([*_sft_rm_args(algo, tiny_task, straight, pairs), "steps=4"]) == 0
    assert train.cli([*_sft_rm_args(algo, tiny_task, resumed, pairs), "steps=2"]) == 0
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["2"]
    code = train.cli([*_sft_rm_args(algo, tiny_task, resumed, pairs), "steps=4", "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "resuming with changed steps: 2 -> 4" in err
    # The first segment ended at step 2 with its final evaluation in that row; otherwise the rows are the same.
    no_eval = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in _stable(read_rows(resumed))]
    assert no_eval == [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in _stable(read_rows(straight))]
    assert _stable(read_rows(resumed))[-1] == _stable(read_rows(straight))[-1]
    first = 0 if algo == "rm" else 1  # the reward model logs its "before" evaluation as step 0
    assert [r["step"] for r in read_rows(resumed)] == list(range(first, 5))
    loss = "sft_loss" if algo == "sft" else "loss"
    assert read_rows(resumed)[-1][loss] == read_rows(straight)[-1][loss]
