"""A newcomer's first hour: README's "Your own model, data and reward" run as written (from another folder, a
YAML with relative paths, a reward module beside it), plain log lines off a terminal, Ctrl-C, the Python API,
--print-config and docs/config-reference.md, the planner on a config, a weights-only final checkpoint, and every command
and Python block of README, docs/ and bench/README.md (parsed and checked, never run)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.runs import ROOT, read_rows, read_samples, read_summary, tiny_run, tiny_run_args

pytestmark = pytest.mark.heavy(seconds=41)

README = ROOT / "README.md"
# The pages whose shell and Python code blocks a test checks (test_docs_commands_name_real_presets_modules_and_flags).
DOC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
SECTION = "## Your own model, data and reward"
# What the test changes in the README's run: a tiny local model instead of the hub's, and a short run.
TINY_RUN = ["steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=8", "eval_size=2",
            "eval_batch_size=2"]


def _section() -> str:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the reward module must import without it
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_readme_section_runs_as_written_from_another_folder(tmp_path, tiny_chat_model):
    section = _section()
    files = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", section, re.S)
    assert {name for name, _ in files} == {"my_task/config.yaml", "my_task/my_rewards.py", "my_task/train.jsonl",
                                           "my_task/test.jsonl"}
    for name, body in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    commands = re.search(r"<!-- commands -->\n```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    assert len(commands) == 2 and all(c.startswith("python train.py ") for c in commands)
    tiny = [f"model.path={tiny_chat_model}", *TINY_RUN]
    runs = []
    for command in commands:  # from tmp_path: neither the repository nor the YAML's folder
        argv = [sys.executable, str(ROOT / "train.py"), *shlex.split(command, comments=True)[2:], *tiny]
        runs.append(subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600))
    printed, trained = runs
    assert printed.returncode == 0, printed.stderr

    # --print-config: every field commented, and the paths resolved against the YAML's folder
    lines = [line for line in printed.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert all("  # " in line for line in lines if not line.lstrip().startswith(("- ", "kwargs", "timeout_s"))), \
        [line for line in lines if "  # " not in line][:3]
    shown = yaml.safe_load(printed.stdout)
    assert shown["model"]["path"] == str(tiny_chat_model)
    assert shown["data"]["train"] == "my_task/train.jsonl" and shown["out_dir"] == "my_task/run"
    assert shown["rewards"][0]["name"] == "my_rewards:last_number_is_answer"

    # training: the user's reward module beside the YAML, the run's outputs beside it too
    assert trained.returncode == 0, trained.stderr[-2000:]
    out = tmp_path / "my_task" / "run"
    rows = read_rows(out)
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert all("reward/my_rewards:last_number_is_answer/mean" in r for r in rows if "reward/mean" in r)
    samples = read_samples(out)
    assert samples and samples[0]["step"] == 1  # samples from the first step, not only every sample_every
    assert "<|im_start|>assistant" in samples[0]["prompt"]  # chat messages rendered with the model's template
    summary = read_summary(out)
    assert "eval/accuracy" in summary["before"] and "eval/accuracy" in summary["after"]

    # off a terminal: plain lines, one per step, and what the run is doing in words
    log = trained.stdout
    assert "\r" not in log
    assert "writing to my_task/run (a new run" in log
    step_lines = [line for line in log.splitlines() if line.startswith("step ") and "/2  reward " in line]
    assert [line.split()[1] for line in step_lines] == ["1/2", "2/2"], log
    assert all("truncated" in line and "s/step" in line for line in step_lines)
    assert "accuracy" in step_lines[-1]  # the final evaluation is on the last step's line
    # A random model's 8-token completions: cut at the limit, and (almost surely) no reward anywhere.
    assert "were cut at sampling.max_new_tokens=8" in log
    truncated = [r["frac_truncated"] for r in rows if "frac_truncated" in r]
    assert max(truncated) >= 0.5
    no_signal = [r["step"] for r in rows if r.get("frac_zero_std_groups") == 1.0]
    if no_signal:
        assert f"warning: step {no_signal[0]}: no learning signal" in log


def test_readme_python_quickstart_runs(tmp_path, tiny_chat_model, monkeypatch, capsys):
    """README's task from Python (docs/configuration.md, "From Python"), on README's files."""
    section = _section()
    docs = (ROOT / "docs" / "configuration.md").read_text()
    code = re.search(r"<!-- python -->\n```python\n(.*?)```", docs, re.S).group(1)
    for name, body in re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", section, re.S):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    replacements = {'"HuggingFaceTB/SmolLM2-135M-Instruct"': repr(str(tiny_chat_model)), '"steps": 100': '"steps": 2',
                    '"max_new_tokens": 32': '"max_new_tokens": 8',
                    '"prompts_per_step": 8, "group_size": 8': '"prompts_per_step": 2, "group_size": 2'}
    for old, new in replacements.items():
        assert code.count(old) == 1, old  # the README changed: update this test's shrinking
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)  # in this process (the API is Python): the snippet reads my_task/ from here
    exec(compile(code, "docs/configuration.md", "exec"), {"__name__": "readme_quickstart"})
    summary = read_summary(tmp_path / "runs" / "my_task_api")
    assert "eval/accuracy" in summary["after"]
    assert "eval/accuracy" in capsys.readouterr().out  # the snippet prints summary["after"]


def characters(prompts, completions, **fields):
    """A plain reward: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def test_python_api_takes_a_function_and_in_memory_records(tmp_path, tiny_task):
    import datasets

    import jaxrl_llm

    records = _records(tiny_task / "train.jsonl")[:40]
    summary = jaxrl_llm.train(
        {"model": {"path": str(tiny_task / "model")}, "out_dir": str(tmp_path / "run"),
         "sampling": {"max_new_tokens": 4}, "data": {"max_prompt_tokens": 16}},
        reward_funcs=[characters], reward_weights=[0.5],
        train_dataset=datasets.Dataset.from_list(records), eval_dataset=records[:4],
        overrides=["rl.prompts_per_step=2", "rl.group_size=2", "progress_bar=false", "tensorboard=false"], steps=2,
    )
    samples = read_samples(tmp_path / "run")
    assert samples
    for s in samples:  # the rewards are the Python function's values, weighted
        assert s["reward/characters"] == float(len(s["completion"]))
        assert s["reward"] == pytest.approx(0.5 * len(s["completion"]))
    assert {s["prompt"] for s in samples} <= {r["prompt"] for r in records}
    assert summary["before"]["eval/characters"] >= 0 and "export" in summary
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["data"]["train"] == "python:train_dataset" and config["rewards"][0]["name"] == "characters"


def test_sigint_checkpoints_the_last_step_and_the_run_resumes(tmp_path, tiny_task, capsys):
    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "grpo_arithmetic.yaml"),
            *tiny_run_args(out, "data.eval=", "checkpoint_every=1000", task=tiny_task)]
    proc = subprocess.Popen([*args, "steps=100000"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: stopped by SIGINT after step ") and "--resume" in last
    step = int(last.split("after step ")[1].split(";")[0])
    checkpoints = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints == [step]  # checkpoint_every=1000: the only one is the interrupt's
    assert [r["step"] for r in read_rows(out)] == list(range(1, step + 1))

    sys.path.insert(0, str(ROOT))
    import train  # the same command, in this process

    assert train.cli([*args[2:], f"steps={step + 2}", "--resume"]) == 0
    assert f"resumed from step {step}" in capsys.readouterr().out
    assert [r["step"] for r in read_rows(out)] == list(range(1, step + 3))


def test_final_checkpoint_weights_keeps_only_the_policy(tmp_path, tiny_task):
    from jaxrl_llm.run.checkpoint import Checkpointer
    from jaxrl_llm.trainers import make_trainer

    def config(steps: int, *extra: str):
        return tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=", "checkpoint_every=1", f"steps={steps}",
                        *extra, task=tiny_task)

    trainer = make_trainer(config(2, "final_checkpoint=weights"))
    trainer.run()
    params = [np.asarray(x) for x in __import__("jax").tree.leaves(trainer.state["params"])]
    directory = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2"]
    checkpointer = Checkpointer(directory)
    assert checkpointer._weights_only(2)
    item = directory / "2" / "state"
    assert not any("opt_state" in str(p) for p in item.rglob("*"))  # no optimizer moments on disk
    checkpointer.close()

    resumed = make_trainer(config(3), resume=True)
    restored = [np.asarray(x) for x in __import__("jax").tree.leaves(resumed.state["params"])]
    assert all(np.array_equal(a, b) for a, b in zip(params, restored, strict=True))
    assert resumed.step == 2
    resumed.run()
    assert [r["step"] for r in read_rows(tmp_path / "run")] == [1, 2, 3]


def test_docs_config_md_is_current():
    from jaxrl_llm.config.docs import DOCS_PATH, markdown

    assert DOCS_PATH.read_text() == markdown(), "run: python -m jaxrl_llm.config.docs --write"


def test_every_config_field_has_a_comment_and_print_config_round_trips(tmp_path, monkeypatch):
    import dataclasses
    import typing

    from jaxrl_llm import config as cfg
    from jaxrl_llm.config.docs import commented_yaml, field_docs

    def sections(cls):
        yield cls
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from sections(tp)

    for cls in [*sections(cfg.RunConfig), cfg.RewardSpec]:
        missing = [f.name for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
        assert not missing, (cls.__name__, missing)
    monkeypatch.chdir(tmp_path)  # outside the repository: every resolved path prints absolute
    config = cfg.load_run_config(ROOT / "configs" / "ppo_rm_arithmetic.yaml", ["rl.beta=0.02", "steps=7"])
    assert config.model.path == str(ROOT / "models" / "arith-base")
    (tmp_path / "printed.yaml").write_text(commented_yaml(config))
    assert cfg.load_run_config(tmp_path / "printed.yaml") == config


def test_yaml_paths_are_relative_to_the_file_and_overrides_to_the_current_folder(tmp_path, monkeypatch):
    from jaxrl_llm.config import load_run_config

    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "model").mkdir()
    (tmp_path / "proj" / "c.yaml").write_text(
        "model: {path: model}\ndata: {train: data/t.jsonl, eval: hf:openai/gsm8k}\nout_dir: runs/x\n"
        "ppo: {critic_init: Org/name}\nrewards: [{name: r:f, kwargs: {path: ../rm}}]\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    c = load_run_config(tmp_path / "proj" / "c.yaml")
    assert c.model.path == str(tmp_path / "proj" / "model")
    assert c.data.train == str(tmp_path / "proj" / "data" / "t.jsonl")
    assert c.data.eval == "hf:openai/gsm8k" and c.ppo.critic_init == "Org/name"  # a hub dataset and a hub id
    assert c.out_dir == str(tmp_path / "proj" / "runs" / "x")
    assert c.rewards[0].kwargs["path"] == str(tmp_path / "rm")
    c = load_run_config(tmp_path / "proj" / "c.yaml", ["data.train=mine.jsonl"])
    assert c.data.train == "mine.jsonl"  # the command line: relative to the current folder, as typed
    monkeypatch.chdir(tmp_path / "proj")
    assert load_run_config(tmp_path / "proj" / "c.yaml").model.path == "model"  # shown relative when inside
    assert str(tmp_path / "proj") in sys.path  # a reward module beside the YAML imports


def test_missing_required_settings_are_one_error_naming_them():
    from jaxrl_llm.config import ConfigError, load_run_config
    from jaxrl_llm.preflight import preflight

    with pytest.raises(ConfigError) as e:
        preflight(load_run_config(None))
    message = str(e.value)
    for name in ("model.path", "data.train", "rewards"):
        assert name in message
    assert "\n" not in message


def test_planner_plans_the_run_a_config_describes(capsys, monkeypatch):
    from jaxrl_llm import memory_plan
    from jaxrl_llm.cli import plan
    from jaxrl_llm.config import load_run_config
    from jaxrl_llm.engine.pages import default_page_size
    from jaxrl_llm.models.hf import config_from_hf

    monkeypatch.chdir(ROOT)
    preset = ROOT / "configs" / "grpo_gsm8k_local.yaml"
    tiny_model = ROOT / "models" / "arith-base"
    overrides = [f"model.path={tiny_model}", "rl.group_size=4", "model.remat=false"]
    assert plan.main(["--config", str(preset), *overrides, "--devices", "8"]) == 0
    printed = capsys.readouterr().out
    c = load_run_config(preset, overrides)
    assert f"rl.prompts_per_step={c.rl.prompts_per_step} x rl.group_size=4" in printed
    expected = memory_plan.plan_memory(
        config_from_hf(plan.load_hf_config_dict(str(tiny_model)), dtype=c.model.dtype,
                       param_dtype=c.model.param_dtype, remat=False,
                       attention_query_chunk=c.model.attention_query_chunk),
        (8, 1, 1), batch=c.rl.prompts_per_step, group_size=4, prompt_len=c.data.max_prompt_tokens,
        new_tokens=c.sampling.max_new_tokens, minibatch=c.rl.minibatch_size, grad_accum=c.rl.grad_accum,
        reference=c.rl.beta > 0, prompt_bucket=c.sampling.prompt_bucket,
        new_tokens_bucket=c.sampling.new_tokens_bucket, logprob_block_mib=c.model.logprob_block_mib,
        engine_page_size=c.sampling.engine_page_size or default_page_size())  # the rollout engine, the default sampler
    assert plan.format_bytes(expected.total) in printed and "mesh data=8 fsdp=1 tensor=1" in printed


FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)
SHELL = {"bash", "sh", "console"}


def _doc_blocks(languages: set[str]):
    """(page, line, language, body) of every fenced code block of DOC_PAGES in one of `languages`."""
    for page in DOC_PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) in languages:
                line = text.count("\n", 0, m.start()) + 1
                yield page.relative_to(ROOT), line, m.group(2), textwrap.dedent(m.group(3))


def _doc_commands():
    """(where, program, argv) of every `python train.py`, `python -m jaxrl_llm X`, `python -m jaxrl_llm.X` (a module's
    own tool) and `python bench/X.py` command in the docs' shell blocks (a console block's commands are its `$ `
    lines; comments and `VAR=value` dropped)."""
    for page, line, language, body in _doc_blocks(SHELL):
        for text in body.replace("\\\n", " ").splitlines():
            if language == "console":
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            tokens = shlex.split(text, comments=True)
            commands, current = [], []
            for token in tokens:
                if token in ("&&", ";", "||", "|"):
                    commands.append(current)
                    current = []
                else:
                    current.append(token)
            commands.append(current)
            for argv in commands:
                while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                    argv = argv[1:]
                argv = [a.strip("[]") for a in argv if a.strip("[]") not in ("", "...")]
                if len(argv) < 2 or not argv[0].endswith("python"):
                    continue
                where = f"{page}:{line}: {shlex.join(argv)}"
                if argv[1] == "train.py":
                    yield where, "train.py", argv[2:]
                elif argv[1] == "-m" and argv[2] == "jaxrl_llm" and len(argv) > 3:
                    yield where, f"jaxrl_llm {argv[3]}", argv[4:]
                elif argv[1] == "-m" and argv[2].startswith("jaxrl_llm."):  # a module's own tool (tasks, config)
                    yield where, argv[2], argv[3:]
                elif argv[1].startswith("bench/"):
                    yield where, argv[1], argv[2:]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace | None) -> None:
        super().__init__()
        self.namespace = namespace


def _parse_only(main, argv: list[str]) -> argparse.Namespace | None:
    """The namespace `main(argv)` parses with argparse, stopping it right there (nothing runs); None for --help."""
    def stop(original):
        def parse(self, args=None, namespace=None):
            raise _Parsed(original(self, args, namespace))
        return parse

    with pytest.MonkeyPatch.context() as patch:
        for name in ("parse_args", "parse_intermixed_args"):
            patch.setattr(argparse.ArgumentParser, name, stop(getattr(argparse.ArgumentParser, name)))
        try:
            main(list(argv))
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:  # --help prints and exits 0; an argparse error exits 2
            if e.code == 0:
                return None
            raise AssertionError(f"argparse exited {e.code}") from None
    raise AssertionError("the command did not parse its arguments with argparse")


def _config_path(path: Path, folders: list[Path]) -> Path:
    for folder in folders:
        if (folder / path).is_file():
            return folder / path
    raise AssertionError(f"config file {path} does not exist")


def test_docs_commands_name_real_presets_modules_and_flags(tmp_path, monkeypatch, capsys):
    """Every command in the docs' shell blocks parses: train.py's options, its preset file and every override key
    (`load_run_config`, which rejects unknown keys), each `python -m jaxrl_llm X` command and its options (its own
    argparse parser, stopped before it runs), and each bench script and the flags it is given. Nothing trains."""
    from jaxrl_llm.config import load_run_config

    for page in DOC_PAGES:  # the files the docs ask a reader to make (README's my_task/, extending's modules)
        for name, body in re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", page.read_text(), re.S):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    import train

    folders = [ROOT, tmp_path]
    commands = list(_doc_commands())
    assert len(commands) >= 30 and {program for _, program, _ in commands} >= {
        "train.py", "jaxrl_llm eval", "jaxrl_llm plan", "bench/sampling.py"}, commands
    failures = []
    for where, program, argv in commands:
        try:
            if program == "train.py":
                args = _parse_only(train.main, argv)
                if args is not None:
                    preset = _config_path(args.config, folders) if args.config else train.DEFAULT_CONFIGS[
                        args.algo or "grpo"]
                    load_run_config(preset, args.overrides, **({"algo": args.algo} if args.algo else {}))
            elif program.startswith("jaxrl_llm "):
                from jaxrl_llm.__main__ import COMMANDS

                command = program.removeprefix("jaxrl_llm ")
                assert command in COMMANDS, f"no command {command} (python -m jaxrl_llm knows {COMMANDS})"
                args = _parse_only(importlib.import_module(f"jaxrl_llm.cli.{command}").main, argv)
            elif program.startswith("jaxrl_llm."):
                assert importlib.util.find_spec(program) is not None, f"no module {program}"
                args = _parse_only(importlib.import_module(program).main, argv)
                if getattr(args, "config", None):
                    load_run_config(_config_path(args.config, folders), getattr(args, "overrides", []))
            else:
                script = ROOT / program
                assert script.is_file(), f"no script {program}"
                source = script.read_text()
                unknown = [a for a in argv if a.startswith("--") and f'"{a.split("=")[0]}"' not in source]
                assert not unknown, f"{program} has no option {unknown}"
        except Exception as e:  # noqa: BLE001 - one list of every broken command
            failures.append(f"{where}\n    {type(e).__name__}: {e}")
    capsys.readouterr()  # --help output
    assert not failures, "\n".join(failures)


def test_docs_python_blocks_compile_and_links_resolve():
    blocks = list(_doc_blocks({"python"}))
    assert len(blocks) >= 5
    for page, line, _, body in blocks:
        compile(body, f"{page}:{line}", "exec")
    missing = []
    for page in DOC_PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert set(missing) <= {"README.md: docs/design.md", "docs/models.md: design.md"}, missing  # design.md: coming
