"""Divergence detection: the pure conditions on hand-made metric sequences, and a learning rate of 1e3 on the
default job's model caught, stopped without export, with the last good checkpoint kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import train
from jaxrl_llm.config import MonitorSection
from jaxrl_llm.run.monitor import DivergenceState, update_divergence
from tests.runs import ROOT, read_rows, read_summary, tiny_run_args

pytestmark = pytest.mark.heavy(seconds=23)

V = 100
LIMITS = MonitorSection(patience=3, entropy_floor=0.01, entropy_ceiling=0.95, kl_max=10.0)


def healthy(reward: float = 0.4, **extra: float) -> dict[str, float]:
    return {"entropy": 1.0, "reward/mean": reward, "reward/std": 0.3, "kl": 0.01, "frac_truncated": 0.2,
            "completion_length/max": 6.0, **extra}


def run(steps: list[dict[str, float]], limits: MonitorSection = LIMITS) -> list[dict[str, str]]:
    state, out = DivergenceState(), []
    for metrics in steps:
        state, diverged = update_divergence(state, metrics, vocab_size=V, settings=limits)
        out.append(diverged)
        state = DivergenceState.from_json(json.loads(json.dumps(state.to_json())))  # survives a checkpoint
    return out


def test_uniform_output_after_a_healthy_start_is_named_after_patience_steps():
    uniform = healthy(entropy=0.97 * math.log(V))
    verdicts = run([healthy(), uniform, uniform, uniform])
    assert verdicts[:3] == [{}, {}, {}]
    assert set(verdicts[3]) == {"entropy_uniform"}
    assert "for 3 steps" in verdicts[3]["entropy_uniform"] and f"{0.95 * math.log(V):.4g}" in verdicts[3][
        "entropy_uniform"]


def test_a_healthy_step_resets_the_streak():
    uniform = healthy(entropy=0.99 * math.log(V))
    assert run([healthy(), uniform, uniform, healthy(), uniform, uniform]) == [{}] * 6


def test_a_run_that_starts_in_a_condition_is_not_diverged():
    """A random model is near-uniform from step 1: that is its baseline, not a collapse."""
    uniform = healthy(entropy=0.99 * math.log(V), **{"reward/std": 0.0, "reward/mean": 0.0, "frac_truncated": 1.0})
    assert run([uniform] * 8) == [{}] * 8


def test_collapse_counts_only_without_reward_gain():
    """Entropy near 0 and one score for all is a solved task when the reward rose, a collapse when it did not."""
    solved = healthy(1.0, entropy=0.001, **{"reward/std": 0.0})
    assert run([healthy(0.4), solved, solved, solved, solved]) == [{}] * 5
    collapsed = healthy(0.0, entropy=0.001, **{"reward/std": 0.0, "frac_truncated": 1.0})
    verdicts = run([healthy(0.4), collapsed, collapsed, collapsed, collapsed])
    assert verdicts[2] == {}
    # "stuck" needs the previous step's equal score, so it is named one step after the others.
    assert set(verdicts[3]) == {"entropy_collapsed", "completions_truncated"}
    assert set(verdicts[4]) == {"entropy_collapsed", "completions_truncated", "reward_stuck"}


def test_kl_explosion_and_empty_completions():
    away = healthy(0.9, kl=25.0)
    assert set(run([healthy(), away, away, away])[3]) == {"kl_exploded"}  # even with the reward up
    empty = healthy(0.0, **{"completion_length/max": 1.0})
    assert set(run([healthy(), empty, empty, empty])[3]) == {"completions_empty"}
    nan_kl = healthy(kl=float("nan"))
    assert set(run([healthy(), nan_kl, nan_kl, nan_kl])[3]) == {"kl_exploded"}


def test_patience_zero_turns_the_checks_off():
    uniform = healthy(entropy=0.99 * math.log(V))
    assert run([healthy(), *[uniform] * 6], MonitorSection(patience=0)) == [{}] * 7


def _args(out: Path, *extra: str) -> list[str]:
    # export=true: the diverged run is what must not export
    return tiny_run_args(out, "optim.learning_rate=1e3", "steps=8", "checkpoint_every=2", "export=true",
                         "monitor.patience=3", *extra)


def test_a_destroyed_policy_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    """The issue's case: the default job with learning rate 1e3 used to exit 0 and export the destroyed model."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    code = train.cli(_args(out))
    err = capsys.readouterr().err
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("train.py: error: step ") and "the policy diverged" in line and "without export" in line
    summary = read_summary(out)
    stop, good = summary["diverged"]["step"], summary["diverged"]["last_good_checkpoint"]
    assert stop < 8 and not (out / "hf").exists()
    assert f"Last good checkpoint: step {good}" in line
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(stop + 1))
    assert rows[-1]["eval/accuracy"] < rows[0]["eval/accuracy"]  # the final policy really is worse
    # The good checkpoint predates every step where a condition held; later ones were set aside, not deleted.
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [good]
    assert rows[good]["reward/std"] > 0
    assert all(int(p.name) > good for p in (out / "diverged_checkpoints").iterdir())
    # on_divergence=warn: the run goes on to the end, exports, and its summary says the policy diverged.
    warned = tmp_path / "warned"
    assert train.cli([*_args(warned, "data.eval=", "steps=7"), "monitor.on_divergence=warn", "export=true"]) == 0
    err = capsys.readouterr().err
    assert "warning: the final policy diverged" in err
    assert read_summary(warned)["diverged"]["conditions"]
    assert (warned / "hf" / "config.json").is_file()


@pytest.mark.parametrize("bad", ["monitor.patience=-1", "monitor.entropy_ceiling=1.5",
                                 "monitor.kl_max=0"])
def test_divergence_settings_are_validated(bad, tmp_path, capsys):
    assert train.cli([f"out_dir={tmp_path}", bad]) == 2
    assert bad.split("=")[0] in capsys.readouterr().err
