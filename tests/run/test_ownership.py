"""Nothing lost: a run owns only what it wrote (its manifest), a user's folder and a git work tree are left alone,
`--overwrite` removes exactly the run's files, changed data is caught on `--resume`, and a full or read-only
disk is one line with the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

import train
from jaxrl_llm.run.manifest import MANIFEST_NAME, claim, foreign_entry, new_manifest, read_manifest, write_manifest
from tests.runs import ROOT, read_rows, tiny_run_args

pytestmark = pytest.mark.heavy(seconds=20)

USER_FILES = {  # a user's folder whose files are named like run outputs
    "configs/my_experiment.yaml": "rl: {beta: 0.1}\n",
    "eval/results.txt": "accuracy 0.9\n",
    "report/paper.tex": "\\section{Results}\n",
    "config.yaml": "steps: 3\n",
    "notes.txt": "my notes\n",
}


def _base(task: Path, out: Path | str) -> list[str]:
    return tiny_run_args(out, task=task)


def _yaml(overrides: list[str]) -> str:
    """The default preset with the `key=value` overrides applied, as a YAML file of a user's own."""
    tree = yaml.safe_load((ROOT / "configs" / "grpo_arithmetic.yaml").read_text())
    for item in overrides:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value) if value else ""
    return yaml.safe_dump(tree)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(root).parts}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = train.cli(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.strip()]


def _error(lines: list[str]) -> str:
    errors = [line for line in lines if line.startswith("train.py: error: ")]
    assert len(errors) == 1, lines
    return errors[0]


# ------------------------------------------------------------------------------------------ the manifest


def test_claim_records_the_shortest_new_part_of_a_path(tmp_path):
    run = tmp_path / "run"
    (run / "configs").mkdir(parents=True)  # a folder that was there before the run
    write_manifest(run, new_manifest(["configs"]))
    claim(run, run / "configs" / "001-start.yaml")  # into a folder it did not create: the file alone
    claim(run, run / "checkpoints" / "1" / "state")  # a new folder: the folder
    (run / "checkpoints" / "1").mkdir(parents=True)
    claim(run, run / "checkpoints" / "2")  # inside its own folder: nothing new
    claim(run, tmp_path / "elsewhere")  # outside the run: nothing
    assert read_manifest(run)["created"] == ["checkpoints", "configs/001-start.yaml"]
    (run / "configs" / "001-start.yaml").write_text("x")
    (run / "configs" / "mine.yaml").write_text("y")  # a user's file in the kept folder
    manifest = read_manifest(run)
    manifest["kept"] = []
    assert foreign_entry(run, manifest) == run / "configs" / "mine.yaml"
    assert foreign_entry(run, read_manifest(run)) is None  # "configs" kept as a whole


# ------------------------------------------------------------------------------------------ a user's folder


@pytest.mark.parametrize("overwrite", [False, True], ids=["start", "overwrite"])
def test_a_users_folder_named_like_run_outputs_is_never_touched(overwrite, tiny_task, tmp_path, capsys):
    """The issue's case: configs/, eval/, report/, config.yaml and notes.txt are a user's, not a run's."""
    folder = tmp_path / "mine"
    _write(folder, USER_FILES)
    before = _files(folder)
    code, lines = _cli([*_base(tiny_task, folder), *(["--overwrite"] if overwrite else [])], capsys)
    message = _error(lines)
    assert code == 2
    assert f"out_dir={folder} is not empty" in message and "holds no run" in message
    assert str(folder / "config.yaml") in message  # names one of the files
    if overwrite:
        assert "nothing was removed" in message
    assert not any("removing" in line or "removed" in line.split("error:")[0] for line in lines)
    assert _files(folder) == before
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "configs", "eval", "notes.txt", "report"]


def test_a_run_in_its_config_files_folder_leaves_the_users_files_alone(tiny_task, tmp_path, capsys):
    """`out_dir: .` beside the YAML: the run writes beside the user's files, never over them, and
    `--overwrite` removes exactly what the run created."""
    folder = tmp_path / "experiment"
    user = {k: v for k, v in USER_FILES.items() if not k.startswith("configs/")}
    user["config.yaml"] = _yaml(_base(tiny_task, "."))
    _write(folder, user)
    before = _files(folder)
    argv = ["--config", str(folder / "config.yaml"), "report=true"]
    code, lines = _cli(argv, capsys)
    assert code == 0, lines
    assert any("report skipped" in line and "report was not written by the run" in line for line in lines)
    assert {k: v for k, v in _files(folder).items() if k in before} == before  # every user file as it was
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["created"] == ["checkpoints", "configs", "metrics.jsonl", "samples.jsonl", "summary.json"]
    assert manifest["kept"] == ["config.yaml", "eval", "notes.txt", "report"]
    assert (folder / "configs" / "001-start.yaml").is_file()

    # A second start without --overwrite is refused; with it, the run's files go and the user's stay.
    code, lines = _cli(argv, capsys)
    assert code == 2 and "holds another run" in _error(lines)
    code, lines = _cli([*argv, "--overwrite", "seed=3"], capsys)
    assert code == 0, lines
    removed = next(line for line in lines if "--overwrite: removed" in line)
    assert removed.endswith("checkpoints, configs, metrics.jsonl, samples.jsonl, summary.json")
    assert {k: v for k, v in _files(folder).items() if k in before} == before
    assert "seed: 3" in (folder / "configs" / "001-start.yaml").read_text()

    # A file the run did not create, put there since: --overwrite refuses and removes nothing.
    (folder / "later.txt").write_text("results I wrote down")
    (folder / "checkpoints" / "keep-me.txt").write_text("inside the run's own folder")
    snapshot = _files(folder)
    code, lines = _cli([*argv, "--overwrite"], capsys)
    message = _error(lines)
    assert code == 2 and "which the run did not create" in message and "nothing was removed" in message
    assert "later.txt" in message or "keep-me.txt" in message
    assert _files(folder) == snapshot


def test_a_run_output_name_in_the_config_folder_refuses_the_start(tiny_task, tmp_path, capsys):
    folder = tmp_path / "experiment"
    _write(folder, {"configs/my_experiment.yaml": "x: 1\n", "metrics.jsonl": "{}\n"})
    (folder / "run.yaml").write_text(_yaml(_base(tiny_task, ".")))
    before = _files(folder)
    code, lines = _cli(["--config", str(folder / "run.yaml")], capsys)
    message = _error(lines)
    assert code == 2 and "is the config file's folder and already holds" in message
    assert "configs" in message or "metrics.jsonl" in message
    assert _files(folder) == before


def test_a_fresh_start_never_replaces_a_config_yaml_it_did_not_write(tiny_task, tmp_path, capsys):
    folder = tmp_path / "experiment"
    yaml_text = _yaml(_base(tiny_task, "."))
    _write(folder, {"config.yaml": yaml_text + "# my comments\n"})
    code, lines = _cli(["--config", str(folder / "config.yaml"), "seed=7"], capsys)
    assert code == 0, lines
    assert (folder / "config.yaml").read_text() == yaml_text + "# my comments\n"
    assert "seed: 7" in (folder / "configs" / "001-start.yaml").read_text()
    assert any("config.yaml is not this run's" in line for line in lines)


# ------------------------------------------------------------------------------------------ git work trees


@pytest.fixture
def git_tree(tmp_path):
    """A git work tree holding a copy of this repository's presets, tracked."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "clone"
    shutil.copytree(ROOT / "configs", repo / "configs")
    (repo / "README.md").write_text("a project\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "presets"]):
        subprocess.run(["git", *argv], cwd=repo, check=True, env=env, capture_output=True)
    return repo


def test_out_dir_dot_in_a_git_work_tree_is_refused(git_tree, tiny_task, capsys, monkeypatch):
    """The issue's case: `out_dir=. --overwrite` in a clone wrote into the root and, run twice, deleted the
    tracked presets."""
    monkeypatch.chdir(git_tree)
    before = _files(git_tree)
    for _ in range(2):
        code, lines = _cli([*_base(tiny_task, "."), "--overwrite"], capsys)
        assert code == 2 and "out_dir=. is the root of a git work tree" in _error(lines)
        assert "--allow-tracked-dir" in _error(lines)
    code, lines = _cli([*_base(tiny_task, "configs")], capsys)
    assert code == 2 and "out_dir=configs holds files tracked by git (" in _error(lines)
    assert _files(git_tree) == before
    status = subprocess.run(["git", "status", "--porcelain"], cwd=git_tree, capture_output=True, text=True).stdout
    assert status == ""
    # A new folder inside the tree holds no tracked file: allowed, as runs/NAME is.
    code, lines = _cli(_base(tiny_task, "runs/mine"), capsys)
    assert code == 0, lines
    assert _files(git_tree / "configs") == {k.removeprefix("configs/"): v for k, v in before.items()
                                            if k.startswith("configs/")}


def test_allow_tracked_dir_writes_beside_tracked_files_and_leaves_them_alone(git_tree, tiny_task, capsys,
                                                                             monkeypatch):
    (git_tree / "run.yaml").write_text(_yaml(_base(tiny_task, ".")))
    subprocess.run(["git", "add", "run.yaml"], cwd=git_tree, check=True)
    tracked = _files(git_tree)
    code, lines = _cli(["--config", str(git_tree / "run.yaml")], capsys)
    assert code == 2 and "is the root of a git work tree" in _error(lines)
    # the presets' configs/ is in the way of the run's config history: refused even when asked
    code, lines = _cli(["--config", str(git_tree / "run.yaml"), "--allow-tracked-dir"], capsys)
    assert code == 2 and "already holds" in _error(lines) and "configs" in _error(lines)
    shutil.rmtree(git_tree / "configs")
    subprocess.run(["git", "rm", "-rq", "--cached", "configs"], cwd=git_tree, check=True)
    tracked = _files(git_tree)
    code, lines = _cli(["--config", str(git_tree / "run.yaml"), "--allow-tracked-dir"], capsys)
    assert code == 0, lines
    assert {k: v for k, v in _files(git_tree).items() if k in tracked} == tracked


# ------------------------------------------------------------------------------------------ runs before manifests


def test_a_run_from_before_manifests_resumes_and_is_never_overwritten(tiny_task, tmp_path, capsys):
    out = tmp_path / "old"
    base = [*_base(tiny_task, out), "checkpoint_every=1", "data.eval="]
    assert _cli(base, capsys)[0] == 0
    (out / MANIFEST_NAME).unlink()  # as an earlier version left it
    snapshot = _files(out)
    for extra in ([], ["--overwrite"]):
        code, lines = _cli([*base, *extra], capsys)
        message = _error(lines)
        assert code == 2 and "a run from before jaxrl_llm recorded what runs create" in message
        assert "checkpoints, metrics.jsonl, samples.jsonl, summary.json, config.yaml, configs" in message
        assert ("nothing was removed" in message) == bool(extra)
        assert _files(out) == snapshot
    code, lines = _cli([*base, "--resume", "steps=2"], capsys)
    assert code == 0, lines
    assert any("from now on its new files are recorded" in line for line in lines)
    assert [r["step"] for r in read_rows(out)] == [1, 2]
    code, lines = _cli([*base, "--overwrite", "steps=2"], capsys)  # still refused: its old files are unrecorded
    assert code == 2 and "nothing was removed" in _error(lines)
    assert (out / "checkpoints" / "1").is_dir()


# ------------------------------------------------------------------------------------------ data fingerprints


def test_resume_refuses_changed_data_unless_allowed(tiny_task, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(tiny_task / "train.jsonl", data / "train.jsonl")
    out = tmp_path / "run"
    base = [*_base(tiny_task, out), f"data.train={data / 'train.jsonl'}", "data.eval=", "checkpoint_every=1"]
    assert _cli(base, capsys)[0] == 0
    recorded = json.loads((out / MANIFEST_NAME).read_text())["data"]["data.train"]
    assert recorded["size"] == (data / "train.jsonl").stat().st_size and len(recorded["sha256"]) == 64

    # touched, same bytes: resumes
    os.utime(data / "train.jsonl", ns=(1, 1))
    assert _cli([*base, "--resume", "steps=2"], capsys)[0] == 0

    # the case: 50 lines deleted, 100 others appended
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    extra = (tiny_task / "test.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[50:] + (extra * 3)[:100]))
    code, err = _cli([*base, "--resume", "steps=3"], capsys)
    message = _error(err)
    assert code == 2 and f"data.train file {data / 'train.jsonl'} changed since the run started" in message
    assert "--allow-config-change" in message
    code, err = _cli([*base, "--resume", "steps=3", "--allow-config-change"], capsys)
    assert code == 0 and any("resuming on the changed data.train file" in line for line in err)

    # same size, other bytes: caught by the hash
    text = (data / "train.jsonl").read_text()
    (data / "train.jsonl").write_text(text.replace("1", "7", 1))
    code, err = _cli([*base, "--resume", "steps=4"], capsys)
    assert code == 2 and "same size, different bytes" in _error(err)


# ------------------------------------------------------------------------------------------ the disk


def _mount_tmpfs(where: Path, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "small"
    _mount_tmpfs(where, "size=480k")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_disk_full_is_one_line_and_the_previous_checkpoint_is_intact(tiny_task, small_disk, capsys):
    """Each checkpoint of the tiny model is about 200 KB, on a 480 KB disk: the second or third write fails."""
    out = small_disk / "run"
    base = [*_base(tiny_task, out), "steps=4", "checkpoint_every=1", "keep_checkpoints=5", "data.eval=",
            "sample_every=0"]
    code, lines = _cli(base, capsys)
    assert code == 2, lines
    assert len(lines) == 1 or all(not line.startswith(("ERROR", "Traceback", "  File")) for line in lines), lines
    message = _error(lines)
    assert "no space left on device while writing checkpoint" in message and str(out / "checkpoints") in message
    failed = int(message.split("writing checkpoint ")[1].split()[0])
    assert failed >= 2
    assert f"the checkpoint of step {failed - 1} is intact" in message
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == list(range(1, failed))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    code, lines = _cli([*base, "--resume"], capsys)
    assert code == 0, lines
    assert any(f"resumed from the checkpoint of step {failed - 1}" in line for line in lines)
    assert [r["step"] for r in read_rows(out)] == [1, 2, 3, 4]


def test_a_read_only_out_dir_exits_2_with_one_line(tiny_task, tmp_path, capsys):
    where = tmp_path / "ro"
    _mount_tmpfs(where, "ro,size=1m")
    try:
        code, lines = _cli(_base(tiny_task, where / "run"), capsys)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
    assert code == 2
    assert _error(lines).startswith("train.py: error: file system: read-only file system at ")


# ------------------------------------------------------------------------------------------ SIGTERM


def sigterm_on_second_call(prompts, completions, **fields):
    """An exact-answer reward that sends SIGTERM to its own process during step 2 (the last)."""
    from jaxrl_llm.rewards import math_answer_reward

    sigterm_on_second_call.calls = getattr(sigterm_on_second_call, "calls", 0) + 1
    if sigterm_on_second_call.calls == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return math_answer_reward(prompts, completions, **fields)


def test_sigterm_in_the_last_step_saves_it_and_stops_without_export(tiny_task, tmp_path, capsys, monkeypatch):
    """The notice says what happens: the step's checkpoint, then a stop (exit 130, no export); --resume exports."""
    out = tmp_path / "run"
    base = [*_base(tiny_task, out), "steps=2", "data.eval=", "export=true", "checkpoint_every=0",
            "rewards=[{name: 'tests.run.test_ownership:sigterm_on_second_call', timeout_s: 0}]"]
    sigterm_on_second_call.calls = 0
    code, lines = _cli(base, capsys)
    assert code == 130, lines
    assert any("SIGTERM: finishing this step, then saving its checkpoint and stopping (no export)" in line
               for line in lines)
    assert any("stopped by SIGTERM after step 2" in line for line in lines)
    assert not (out / "hf").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]
    code, lines = _cli([*base, "--resume"], capsys)
    assert code == 0, lines
    assert (out / "hf" / "model.safetensors").is_file()
    assert "hf" in json.loads((out / MANIFEST_NAME).read_text())["created"]


def test_overwrite_replaces_only_an_export_the_run_wrote(tiny_task, tmp_path, capsys):
    out, export = tmp_path / "run", tmp_path / "exported"
    base = [*_base(tiny_task, out), "export=true", f"export_dir={export}", "data.eval="]
    assert _cli(base, capsys)[0] == 0
    assert json.loads((out / MANIFEST_NAME).read_text())["exports"] == [str(export.resolve())]
    code, lines = _cli([*base, "--overwrite", "seed=2"], capsys)  # the run's own export: replaced
    assert code == 0, lines
    assert any("replace the model files this run wrote" in line for line in lines)
    users = tmp_path / "users_model"
    _write(users, {"config.json": "{}", "README.md": "my model card\n"})
    before = _files(users)
    code, lines = _cli([*base, "--overwrite", f"export_dir={users}"], capsys)
    assert code == 2 and "holds files that no start of this run exported" in _error(lines)
    assert _files(users) == before


def test_resume_of_a_run_whose_config_predates_new_fields(tiny_task, tmp_path, capsys):
    """A field added since the run started ran at its default then: not a config change; and a run written
    before the `rl.loss` section (the loss's keys flat in `rl`, `loss_aggregation`) resumes under the new names."""
    out = tmp_path / "run"
    base = [*_base(tiny_task, out), "checkpoint_every=1", "data.eval="]
    assert _cli(base, capsys)[0] == 0
    start = out / "configs" / "001-start.yaml"
    tree = yaml.safe_load(start.read_text())
    loss = tree["rl"].pop("loss")
    del loss["top_entropy_quantile"], loss["kl_cov_ratio"]
    aggregation = loss.pop("aggregation")
    tree["rl"] |= {**loss, "loss_aggregation": aggregation}  # the layout of before rl.loss
    start.write_text(yaml.safe_dump(tree))
    code, lines = _cli([*base, "--resume", "steps=2"], capsys)
    assert code == 0, lines
    code, lines = _cli([*base, "--resume", "steps=3", "rl.loss.kl_cov_ratio=0.1"], capsys)
    assert code == 2 and "rl.loss.kl_cov_ratio: 0.0 -> 0.1" in _error(lines)
