"""Named diagnostics: the repetition and drift-KL formulas, each symptom on a constructed metrics history, and
on constructed runs (a reward that is always 0, a huge learning rate) while a short default-task run stays
silent and shows the drift KL, not the on-policy ratio's KL, on its progress line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import MonitorSection
from jaxrl_llm.run.monitor import HINTS, diagnose, drift_kl, repeated_ngram_fraction
from jaxrl_llm.trainers import make_trainer
from tests.runs import read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=15)


def always_zero(prompts, completions, **fields):
    return [0.0] * len(completions)


def parity(prompts, completions, **fields):
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


def test_repeated_ngram_fraction_counts_repeats():
    tokens = np.array([[5, 5, 5, 5, 5, 0], [1, 2, 3, 1, 2, 3], [1, 2, 9, 9, 9, 9]])
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    # row 0: 3 grams (5,5,5) x3 -> 2 repeats; row 1: 4 grams, (1,2,3) twice -> 1 repeat; row 2: too short.
    assert repeated_ngram_fraction(tokens, mask) == pytest.approx(3 / 7)
    assert repeated_ngram_fraction(tokens[1:2], mask[1:2], n=2) == pytest.approx(2 / 5)
    assert repeated_ngram_fraction(tokens[2:], mask[2:]) == 0.0


def test_drift_kl_is_the_k3_estimate_and_is_exact_in_expectation():
    logp = np.log(np.array([[0.5, 0.25, 0.9]]))
    initial = np.log(np.array([[0.25, 0.5, 0.1]]))
    mask = np.array([[1, 1, 0]])
    d = initial - logp
    assert drift_kl(logp, initial, mask) == pytest.approx(((np.exp(d) - d - 1) * mask).sum() / 2)
    assert drift_kl(logp, logp, mask) == 0.0
    # Sampled from p, the estimate's mean is KL(p || q).
    rng = np.random.default_rng(0)
    p, q = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3])
    x = rng.choice(3, size=200_000, p=p)
    assert drift_kl(np.log(p[x])[None], np.log(q[x])[None], np.ones((1, x.size))) == pytest.approx(
        float((p * np.log(p / q)).sum()), rel=0.02)


def _steps(n: int, **overrides: float) -> list[dict[str, float]]:
    base = {"reward/mean": 0.5, "reward/std": 0.3, "entropy": 1.0, "kl": 0.01, "completion_length/mean": 20.0,
            "frac_truncated": 0.1, "frac_empty": 0.0, "repetition/ngram_frac": 0.05, "frac_zero_std_groups": 0.3,
            "tokens_per_second": 1000.0}
    return [dict(base) for _ in range(n - 1)] + [{**base, **overrides}]


@pytest.mark.parametrize(("name", "history"), [
    ("empty_completions", _steps(4, frac_empty=0.6)),
    ("all_truncated", _steps(4, frac_truncated=1.0)),
    ("reward_zero", [{**h, "reward/mean": 0.0, "reward/std": 0.0} for h in _steps(10)]),
    ("reward_constant", [{**h, "reward/mean": 0.7, "reward/std": 0.0} for h in _steps(10)]),
    ("entropy_collapse", _steps(5, entropy=0.05)),
    ("kl_blowup", _steps(4, kl=3.0)),
    ("kl_blowup", _steps(4, drift_kl=float("nan"))),
    ("length_collapse", _steps(5, **{"completion_length/mean": 3.0})),
    ("length_explosion", _steps(5, **{"completion_length/mean": 100.0})),
    ("repetition", _steps(4, **{"repetition/ngram_frac": 0.8})),
    ("zero_variance_groups", [{**h, "frac_zero_std_groups": 1.0} for h in _steps(5)]),
    ("throughput_drop", _steps(13) + [{**h, "tokens_per_second": 300.0} for h in _steps(10)]),
])
def test_each_symptom_fires_alone_on_its_history(name, history):
    found = diagnose(history)
    assert list(found) == [name]
    assert name in HINTS
    # One step short of its threshold (or its baseline), it stays silent.
    assert diagnose(_steps(len(history))) == {}


def test_thresholds_bound_the_symptoms():
    limits = MonitorSection()
    assert diagnose([{**h, "reward/mean": 0.0, "reward/std": 0.0} for h in _steps(9)], limits) == {}
    assert diagnose([{**h, "frac_zero_std_groups": 1.0} for h in _steps(4)], limits) == {}
    # entropy collapse while the reward rose is a converged policy, not a symptom.
    assert diagnose(_steps(5, entropy=0.05, **{"reward/mean": 0.9})) == {}
    assert diagnose(_steps(4, kl=3.0), MonitorSection(warnings=False)) == {}


def _tiny(task: Path, out: Path, reward: str, *overrides: str):
    return tiny_run("grpo_arithmetic", out, "data.eval=", "checkpoint_every=0", "monitor.on_divergence=warn",
                    *overrides, task=task, rewards=[{"name": reward}])


class FakeWandb:
    """Stands in for the wandb package (not installed here): records what the logger sends."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self):
        self.finished += 1


def test_a_reward_that_is_always_zero_is_named_and_wandb_gets_the_same_rows(tiny_task, tmp_path, capsys,
                                                                          monkeypatch):
    import sys

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "zero"
    summary = make_trainer(_tiny(tiny_task, out, "tests.run.test_diagnostics:always_zero", "steps=3",
                                 "monitor.reward_steps=3", "logging.wandb=true")).run()
    rows = read_rows(out, "reward/mean")
    assert [r.get("diagnostics/reward_zero") for r in rows] == [None, None, 1.0]
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["config"]["steps"] == 3 and fake.finished == 1
    assert [(s, r) for s, r in fake.logged if "reward/mean" in r] == [
        (r["step"], {k: v for k, v in r.items() if k != "step" and isinstance(v, float)}) for r in rows]
    assert summary["diagnostics"]["reward_zero"] == {"first_step": 3, "last_step": 3, "steps": 1}
    assert "diagnostic reward_zero: every completion scored 0 for 3 steps; hint:" in capsys.readouterr().out


def test_a_huge_learning_rate_names_the_blow_up_and_the_collapse(tiny_task, tmp_path, capsys):
    out = tmp_path / "huge"
    summary = make_trainer(_tiny(tiny_task, out, "tests.run.test_diagnostics:parity", "steps=4", "eval_every=1",
                                 "optim.learning_rate=3.0", "optim.warmup_steps=0",
                                 "monitor.baseline_steps=1", "model.dtype=float32")).run()
    rows = read_rows(out, "reward/mean")
    assert all(r["drift_kl"] > 1.0 for r in rows)  # beta = 0, yet the drift from the initial policy is logged
    assert summary["diagnostics"]["kl_blowup"]["first_step"] == 1
    assert "entropy_collapse" in summary["diagnostics"]
    assert rows[-1]["entropy"] < 0.1 * rows[0]["entropy"]
    log = capsys.readouterr().out
    assert "diagnostic kl_blowup: drift KL to the initial policy" in log
    assert "diagnostic entropy_collapse" in log


def test_the_default_task_stays_silent_and_shows_drift_not_the_ratio_kl(tmp_path, capsys):
    out = tmp_path / "default"
    # the preset's own 16 x 8 rollouts: with 4 x 4 a step of the default task trips a diagnostic
    config = tiny_run("grpo_arithmetic", out, "rl.prompts_per_step=16", "rl.group_size=8", "steps=4", "eval_every=2",
                      "checkpoint_every=0", "monitor.patience=1", "monitor.reward_steps=2",
                      "monitor.baseline_steps=1")
    summary = make_trainer(config).run()
    rows = read_rows(out, "reward/mean")
    assert [r["diagnostics/count"] for r in rows] == [0.0] * 4
    assert "diagnostics" not in summary
    drift = [r["drift_kl"] for r in rows if "drift_kl" in r]
    assert len(drift) == 2 and all(0 < d < 0.1 for d in drift)
    log = capsys.readouterr().out
    assert "diagnostic" not in log
    lines = [x for x in log.splitlines() if x.startswith("step 4/4")]
    assert " drift " in lines[0] and " kl " not in lines[0] and "approx_kl" not in lines[0]


def test_wandb_missing_is_a_clear_error(tiny_task, tmp_path, monkeypatch):
    import sys

    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.preflight import preflight

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    config = _tiny(tiny_task, tmp_path / "w", "math_answer", "logging.wandb=true")
    with pytest.raises(ConfigError, match="logging.wandb=true needs the wandb package, which is not installed"):
        preflight(config)
