"""`compare`: the blind sheet's key maps every response back to the model that wrote it, labels are shuffled
across prompts, the judge's win rates are the formula's, and `--reveal` joins votes with the key. `report`: a
short run's report has every plot with data, and every image loads in a real headless browser."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import load_run_config
from jaxrl_llm.errors import DataError
from jaxrl_llm.trainers import make_trainer

ROOT = Path(__file__).resolve().parents[1]


def parity(prompts, completions, **fields):
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


@pytest.fixture(scope="module")
def run3(tiny_task, tmp_path_factory):
    """Three GRPO steps (beta > 0), evaluated, sampled and checkpointed at every step."""
    out = tmp_path_factory.mktemp("compare_report") / "run"
    config = load_run_config(ROOT / "configs" / "grpo_arithmetic.yaml", [
        f"model.path={tiny_task / 'model'}", f"data.train={tiny_task / 'train.jsonl'}",
        f"data.eval={tiny_task / 'test.jsonl'}", f"out_dir={out}", "rl.prompts_per_step=4", "rl.group_size=4",
        "steps=3", "checkpoint_every=1", "keep_checkpoints=3", "eval_every=1", "eval_size=16",
        "eval_batch_size=16", "sample_every=1", "rl.beta=0.04", "optim.learning_rate=0.1",
        "optim.warmup_steps=0", "progress_bar=false", "tensorboard=false", "export=false",
        "sampling.max_new_tokens=8"], rewards=[{"name": "test_compare_report:parity"}])
    make_trainer(config).run()
    return out


def test_blind_assignment_shuffles_labels_evenly_and_reproducibly():
    from jaxrl_llm.compare import blind_assignment

    a = blind_assignment(600, 3, seed=1)
    assert a == blind_assignment(600, 3, seed=1) and a != blind_assignment(600, 3, seed=2)
    assert all(sorted(order) == [0, 1, 2] for order in a)
    counts = np.zeros((3, 3))
    for order in a:
        for slot, model in enumerate(order):
            counts[model, slot] += 1
    assert np.all(np.abs(counts - 200) < 45)  # each model under each label ~1/3 of the time (sd ~11.5)
    assert len({tuple(o) for o in a}) == 6  # all 3! orders occur


def test_win_rates_and_reveal_follow_their_formulas():
    from jaxrl_llm.compare import key_of, reveal, win_rates

    scores = np.array([[1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 1.0, 1.0]])
    rates = win_rates(scores, ["a", "b"])
    o = np.array([1.0, 0.5, 0.5, 0.0])
    half = 1.96 * o.std() / 2
    assert rates["a vs b"] == pytest.approx((0.5, 0.5 - half, 0.5 + half))
    key = key_of(["m0", "m1"], [[1, 0], [0, 1], [1, 0]], seed=0)
    votes = [{"prompt_id": "0", "preferred": "A"}, {"prompt_id": "1", "preferred": "b"},
             {"prompt_id": "2", "preferred": ""}]
    shares = reveal(votes, key)
    assert shares["m1"][0] == 1.0 and shares["m0"][0] == 0.0  # A of prompt 0 and B of prompt 1 are m1
    with pytest.raises(DataError, match="prompt_id '0' / preferred 'C' is not in the key"):
        reveal([{"prompt_id": "0", "preferred": "C"}], key)


def test_compare_sheet_key_maps_back_exactly_and_the_judge_scores(run3, tiny_task, tmp_path, capsys):
    from jaxrl_llm.compare import main
    from jaxrl_llm.config import DataSection
    from jaxrl_llm.data import build_prompt_set, load_records
    from jaxrl_llm.evaluation import generate_scored
    from jaxrl_llm.export import load_model
    from jaxrl_llm.sampling import SamplingConfig

    models = [str(tiny_task / "model"), f"{run3}:1", f"{run3}:3"]
    out = tmp_path / "cmp"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((tiny_task / "test.jsonl").read_text().splitlines(keepends=True)[:8]))
    assert main(["--models", *models, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8",
                 "--judge", "test_compare_report:parity", "--seed", "3"]) == 0
    with (out / "sheet.csv").open() as f:
        rows = list(csv.DictReader(f))
    key = json.loads((out / "key.json").read_text())
    assert len(rows) == 8 * 3 and "m" not in {r["label"] for r in rows}
    # Each model's own greedy answers, generated directly.
    records, label = load_records(str(prompts))
    direct = {}
    for spec in models:
        m = load_model(spec)
        ps = build_prompt_set(records, label, DataSection(max_prompt_tokens=1 << 30), m.tokenizer)
        sampling = SamplingConfig(max_new_tokens=8, greedy=True, eos_ids=m.eos_ids, pad_id=m.pad_id)
        direct[spec] = generate_scored(m.params, m.model_config, m.tokenizer, ps, ("parity", parity),
                                       sampling).completions
    assert len({tuple(v) for v in direct.values()}) == 3  # the models answer differently: the mapping matters
    for r in rows:
        assert r["response"] == direct[key["labels"][r["prompt_id"]][r["label"]]][int(r["prompt_id"])]
    orders = {tuple(key["labels"][str(p)][x] for x in "ABC") for p in range(8)}
    assert len(orders) > 1  # labels are shuffled across prompts
    html = (out / "sheet.html").read_text()
    assert all(name not in html for name in models)  # the sheet is blind
    # The judge's win rates are the formula's, from the saved scores.
    scores = np.array(json.loads((out / "judge.json").read_text())["scores"])
    for i, spec in enumerate(models):
        assert scores[i].tolist() == parity(None, direct[spec])
    printed = capsys.readouterr().out
    o = np.where(scores[1] > scores[2], 1.0, np.where(scores[1] == scores[2], 0.5, 0.0))
    assert 0 < o.mean() < 1 and o.std() > 0  # a pair with wins and losses, so the number can be wrong
    half = 1.96 * o.std() / np.sqrt(8)
    assert re.search(rf"{re.escape(models[1])} vs {re.escape(models[2])}\s+{o.mean():.3f}  "
                     rf"\[{o.mean() - half:.3f}, {o.mean() + half:.3f}\]", printed)
    # --reveal: votes that always pick the final checkpoint's answer give it every vote.
    with (out / "votes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt_id", "preferred"])
        for p in range(8):
            writer.writerow([p, next(lab for lab, m in key["labels"][str(p)].items() if m == models[2])])
    main(["--reveal", str(out / "votes.csv")])
    printed = capsys.readouterr().out
    assert re.search(rf"{re.escape(models[2])}\s+1.000  \[1.000, 1.000\]", printed)
    assert re.search(rf"{re.escape(models[0])}\s+0.000", printed)


def test_report_has_every_plot_and_every_image_loads_in_a_browser(run3, tmp_path):
    from jaxrl_llm.report import PLOTS, expand_keys, load_run, main, sample_steps

    run = load_run(run3)
    for name, (_, _, left, right) in PLOTS.items():
        assert expand_keys(left + right, run["metrics"]), f"{name}: the short run logs none of its metrics"
    assert sample_steps(run["samples"]) == [1, 2, 3]
    assert sample_steps([{"step": s} for s in range(1, 11)], 3) == [1, 5, 10]
    other = tmp_path / "run_b"
    shutil.copytree(run3, other, ignore=shutil.ignore_patterns("checkpoints", "report"))
    out = tmp_path / "report"
    assert main([str(run3), str(other), "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    for name in PLOTS:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"src='{name}.png'" in page
    assert "run_b" in page and "step 3" in page
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (apt-get install -y chromium): the headless-browser check is skipped")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run([browser, *flags, "--virtual-time-budget=10000", "--dump-dom", (out / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert f'data-images-loaded="{len(PLOTS)}/{len(PLOTS)}"' in dom
    subprocess.run([browser, *flags, "--window-size=1100,2400", f"--screenshot={out / 'screenshot.png'}",
                    (out / "report.html").as_uri()], capture_output=True, timeout=120)
    assert (out / "screenshot.png").stat().st_size > 10_000
