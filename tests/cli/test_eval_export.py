"""`eval` and `export`: the pass@k estimator against its formula and a brute-force count; export of a checkpoint
step equals that step's parameters (and export_dir is honoured); `eval` on a step reproduces the accuracy the
run logged at that step, on the run directory and on the exported HF directory alike."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm.errors import UsageError
from jaxrl_llm.evaluation import default_ks, pass_at_k
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.trainers import make_trainer
from tests.runs import read_rows, tiny_run


def parity(prompts, completions, **fields):
    """A test reward with both outcomes on a random model: 1 when the completion's character codes sum to an even
    number."""
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


def test_pass_at_k_matches_the_formula_and_a_brute_force_count():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                formula = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(formula, abs=1e-12)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # large n: the product form stays exact
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


@pytest.fixture(scope="module")
def short_run(tiny_task, tmp_path_factory):
    """Two GRPO steps with a checkpoint and a held-out evaluation at each, exported to a custom export_dir."""
    root = tmp_path_factory.mktemp("eval_export")
    out, export_dir = root / "run", root / "exported"
    config = tiny_run("grpo_arithmetic", out, f"export_dir={export_dir}", "export=true", "steps=2",
                      "checkpoint_every=1", "keep_checkpoints=3", "eval_every=1",
                      "eval_reward=tests.cli.test_eval_export:parity",
                      "optim.learning_rate=0.01", "optim.warmup_steps=0", "sampling.max_new_tokens=8", task=tiny_task,
                      rewards=[{"name": "tests.cli.test_eval_export:parity"}])
    make_trainer(config).run()
    rows = {r["step"]: r for r in read_rows(out)}
    return out, export_dir, rows


def _checkpoint_params(run: Path, step: int):
    """The params of a checkpoint read with orbax directly (no target: as saved)."""
    state = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "state")
    return jax.tree.map(np.asarray, state["params"])


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def test_export_of_a_step_equals_its_checkpoint_and_export_dir_is_honoured(short_run, tmp_path):
    from jaxrl_llm.cli.export import main

    run, export_dir, _ = short_run
    step1, step2 = _checkpoint_params(run, 1), _checkpoint_params(run, 2)
    assert _max_diff(step1, step2) > 1e-4  # the steps differ, so picking the step matters
    assert main([str(run), "--step", "1", "--out", str(tmp_path / "s1")]) == 0
    _, exported = load_hf_model(tmp_path / "s1")
    assert _max_diff(exported, step1) == 0.0
    assert (tmp_path / "s1" / "tokenizer_config.json").is_file()
    # The run's final export went to export_dir (not out_dir/hf) and is the last step's weights.
    assert not (run / "hf").exists()
    _, final = load_hf_model(export_dir)
    assert _max_diff(final, step2) == 0.0
    with pytest.raises(UsageError, match="no checkpoint of step 7 .*kept: 1, 2"):
        main([str(run), "--step", "7", "--out", str(tmp_path / "s7")])
    with pytest.raises(UsageError, match="already holds files"):
        main([str(run), "--out", str(tmp_path / "s1")])


def test_eval_of_a_step_reproduces_the_logged_accuracy_on_the_run_and_its_export(short_run, tiny_task, tmp_path,
                                                                                 capsys):
    from jaxrl_llm.cli.eval import main
    from jaxrl_llm.cli.export import main as export

    run, _, rows = short_run
    test = str(tiny_task / "test.jsonl")
    for step in (1, 2):
        assert main(["--model", f"{run}:{step}", "--data", test, "--out", str(tmp_path / f"e{step}")]) == 0
        result = json.loads((tmp_path / f"e{step}" / "eval.json").read_text())
        assert result["metrics"]["accuracy"] == rows[step]["eval/accuracy"]
        assert result["metrics"]["reward/mean"] == pytest.approx(rows[step]["eval/tests.cli.test_eval_export:parity"])
        completions = [json.loads(x) for x in (tmp_path / f"e{step}" / "completions.jsonl").read_text().splitlines()]
        assert len(completions) == 16
        assert np.mean([c["reward"] == 1.0 for c in completions]) == result["metrics"]["accuracy"]
        assert np.mean([c["truncated"] for c in completions]) == result["metrics"]["frac_truncated"]
    assert "accuracy" in capsys.readouterr().out
    # The same on the exported HF directory of step 1, with the run's settings given on the command line.
    export([str(run), "--step", "1", "--out", str(tmp_path / "hf1")])
    args = ["--data", test, "--reward", "tests.cli.test_eval_export:parity", "--max-new-tokens", "8", "--limit", "16",
            "--batch-size", "16"]
    main(["--model", str(tmp_path / "hf1"), *args, "--out", str(tmp_path / "hf_eval")])
    result = json.loads((tmp_path / "hf_eval" / "eval.json").read_text())
    assert result["metrics"]["accuracy"] == rows[1]["eval/accuracy"]
    # Through the static sampler (--engine static): the same greedy completions, so the same scores.
    main(["--model", str(tmp_path / "hf1"), *args, "--engine", "static", "--out", str(tmp_path / "static")])
    static = json.loads((tmp_path / "static" / "eval.json").read_text())
    assert static["settings"]["engine"] == "static" and result["settings"]["engine"] == "paged"
    assert static["metrics"] == result["metrics"]
    texts = [[json.loads(x)["completion"] for x in (tmp_path / d / "completions.jsonl").read_text().splitlines()]
             for d in ("hf_eval", "static")]
    assert texts[0] == texts[1]


def test_eval_sampled_pass_at_k_is_the_estimator_over_the_saved_completions(short_run, tiny_task, tmp_path):
    from jaxrl_llm.cli.eval import main

    run, _, _ = short_run
    main(["--model", str(run), "--data", str(tiny_task / "test.jsonl"), "--n", "4", "--temperature", "1.0",
          "--limit", "8", "--out", str(tmp_path / "e")])
    metrics = json.loads((tmp_path / "e" / "eval.json").read_text())["metrics"]
    rows = [json.loads(x) for x in (tmp_path / "e" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * 4
    correct = np.zeros(8, int)
    for r in rows:
        correct[r["prompt_index"]] += r["reward"] == 1.0
    assert 0 < correct.sum() < 32  # both outcomes occur, so the check below can fail
    for k in (1, 2, 4):
        brute = np.mean([sum(any(s) for s in itertools.combinations([1] * c + [0] * (4 - c), k))
                         / math.comb(4, k) for c in correct])
        assert metrics[f"pass@{k}"] == pytest.approx(brute)
    assert metrics["pass@1"] == pytest.approx(metrics["accuracy"])
    assert metrics["completion_length/mean"] == pytest.approx(np.mean([r["length"] for r in rows]))


def test_eval_and_export_errors_are_one_line(tmp_path, tiny_task):
    from jaxrl_llm.cli.eval import main

    with pytest.raises(UsageError, match="nope does not exist"):
        main(["--model", str(tmp_path / "nope"), "--data", str(tiny_task / "test.jsonl"), "--reward", "math_answer"])
    with pytest.raises(UsageError, match="--k needs --n"):
        main(["--model", str(tiny_task / "model"), "--data", "x", "--k", "2"])
    with pytest.raises(UsageError, match="not a run directory"):
        main(["--model", f"{tiny_task / 'model'}:3", "--data", str(tiny_task / "test.jsonl"),
              "--reward", "math_answer"])
