"""`compare`: the blind sheet's key maps every response back to the model that wrote it, labels are shuffled
across prompts, the judge's win rates are the formula's, and `--reveal` joins votes with the key. `report`: a
short run's report has every plot with data, and every image loads in a real headless browser."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from jaxrl_llm.errors import DataError
from jaxrl_llm.trainers import make_trainer
from tests.runs import tiny_run

pytestmark = pytest.mark.heavy(seconds=29)


def parity(prompts, completions, **fields):
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


@pytest.fixture(scope="module")
def run3(tiny_task, tmp_path_factory):
    """Three GRPO steps (beta > 0), evaluated, sampled and checkpointed at every step."""
    out = tmp_path_factory.mktemp("compare_report") / "run"
    config = tiny_run("grpo_arithmetic", out, "steps=3", "checkpoint_every=1", "keep_checkpoints=3", "eval_every=1",
                      "sample_every=1", "rl.beta=0.04", "optim.learning_rate=0.1", "optim.warmup_steps=0",
                      "sampling.max_new_tokens=8", task=tiny_task,
                      rewards=[{"name": "tests.cli.test_compare_report:parity"}])
    make_trainer(config).run()
    return out


def test_blind_assignment_shuffles_labels_evenly_and_reproducibly():
    from jaxrl_llm.cli.compare import blind_assignment

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
    from jaxrl_llm.cli.compare import key_of, reveal, win_rates

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



PROG = "python -m jaxrl_llm compare"
PROMPTS_A = ["1+1=", "2+3=", "4+4=", "5+2=", "9+1="]
PROMPTS_B = ["7*3=", "6*2=", "8*8=", "3*3=", "2*9="]


def write_sheet(out, prompts, seed, monkeypatch, models=("base", "r5")):
    """The sheet, votes template and key that `compare` writes for fixed answers (no model is built: `generate`
    is replaced), with `base` answering "b<prompt>" and `r5` "r<prompt>"; returns the key."""
    from jaxrl_llm.cli import compare

    answers = [[f"b{q}" for q in prompts], [f"r{q}" for q in prompts]]
    monkeypatch.setattr(compare, "generate", lambda args: (list(prompts), answers, None))
    assert compare.main(["--models", *models, "--prompts", "unused.jsonl", "--out", str(out),
                         "--seed", str(seed)]) == 0
    return json.loads((out / "key.json").read_text())


def fill_votes(out, labels):
    """votes.csv as a rater leaves it: the template with `preferred` filled per prompt, other columns kept."""
    with (out / "votes.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row, label in zip(rows, labels, strict=True):
        row["preferred"] = label
    with (out / "votes.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def test_sheet_id_is_the_prompts_labels_and_answers_and_every_file_carries_it(tmp_path, monkeypatch):
    from jaxrl_llm.cli.compare import sheet_id, sheet_rows

    answers = [["x", "y"], ["u", "v"]]
    rows = sheet_rows(["p0", "p1"], answers, [[0, 1], [1, 0]])
    ident = sheet_id(rows)
    assert re.fullmatch(r"[0-9a-f]{16}", ident)
    assert sheet_id([dict(r) for r in reversed(rows)]) == ident  # same content, another row order
    assert sheet_id(sheet_rows(["p0", "p1!"], answers, [[0, 1], [1, 0]])) != ident  # a prompt changed
    assert sheet_id(sheet_rows(["p0", "p1"], answers, [[0, 1], [0, 1]])) != ident  # label -> answer changed
    assert sheet_id(sheet_rows(["p0", "p1"], [["x", "y"], ["u", "w"]], [[0, 1], [1, 0]])) != ident  # an answer
    # The files: the key records the id of the rows in sheet.csv, which carries it on every row, as do the votes
    # template and the page; the id does not depend on which models answered (the key's secret).
    key = write_sheet(tmp_path / "a", PROMPTS_A, 0, monkeypatch)
    with (tmp_path / "a" / "sheet.csv").open(newline="") as f:
        sheet = list(csv.DictReader(f))
    with (tmp_path / "a" / "votes.csv").open(newline="") as f:
        votes = list(csv.DictReader(f))
    assert key["sheet_id"] == sheet_id(sheet) and {r["sheet_id"] for r in sheet} == {key["sheet_id"]}
    assert [v["prompt_id"] for v in votes] == ["0", "1", "2", "3", "4"]
    assert {v["sheet_id"] for v in votes} == {key["sheet_id"]} and {v["preferred"] for v in votes} == {""}
    assert key["sheet_id"] in (tmp_path / "a" / "sheet.html").read_text()
    assert write_sheet(tmp_path / "renamed", PROMPTS_A, 0, monkeypatch, ("m1", "m2"))["sheet_id"] == key["sheet_id"]
    assert write_sheet(tmp_path / "b", PROMPTS_B, 0, monkeypatch)["sheet_id"] != key["sheet_id"]
    assert write_sheet(tmp_path / "s1", PROMPTS_A, 1, monkeypatch)["sheet_id"] != key["sheet_id"]  # other seed


def test_reveal_refuses_another_sheets_key_and_mixed_votes(tmp_path, monkeypatch, capsys):
    """The issue's case: votes for sheet A revealed with the key of sheet B (other prompts)."""
    from jaxrl_llm.cli.compare import main, reveal
    from jaxrl_llm.cli.errors import run_command

    a, b = tmp_path / "a", tmp_path / "b"
    key_a = write_sheet(a, PROMPTS_A, 0, monkeypatch)
    key_b = write_sheet(b, PROMPTS_B, 9, monkeypatch)
    assert [key_a["labels"][str(p)]["A"] for p in range(5)] == ["base"] * 3 + ["r5"] * 2
    assert [key_b["labels"][str(p)]["A"] for p in range(5)] == ["base"] + ["r5"] * 4
    votes = fill_votes(a, ["A"] * 5)  # base on prompts 0-2, r5 on 3-4: base 3/5, r5 2/5
    # Without the check, B's key decodes the same votes as base 1/5, r5 4/5: the wrong answer the issue printed.
    assert reveal(votes, key_b)["base"][0] == pytest.approx(0.2)
    capsys.readouterr()

    # Its own key: the true shares; 0.6 +- 1.96 * sqrt(0.24 / 5) = 0.6 +- 0.429, clipped to [0, 1].
    assert run_command(PROG, main, ["--reveal", str(a / "votes.csv"), "--key", str(a / "key.json")]) == 0
    printed = capsys.readouterr()
    assert "share of the votes (5 votes" in printed.out and printed.err == ""
    assert re.search(r"base\s+0\.600  \[0\.171, 1\.000\]", printed.out)
    assert re.search(r"r5\s+0\.400  \[0\.000, 0\.829\]", printed.out)

    # Another sheet's key: exit 2, one line naming both files and both ids, and no shares.
    assert run_command(PROG, main, ["--reveal", str(a / "votes.csv"), "--key", str(b / "key.json")]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and len(printed.err.strip().splitlines()) == 1
    assert printed.err.strip() == (
        f"{PROG}: error: {a / 'votes.csv'} is for sheet {key_a['sheet_id']} but {b / 'key.json'} is the key of "
        f"sheet {key_b['sheet_id']}; reveal a sheet's votes with its own key")

    # The votes of both sheets in one file: refused with either key, naming both ids.
    votes_b = fill_votes(b, ["B"] * 5)
    mixed = tmp_path / "mixed.csv"
    with mixed.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(votes[0]))
        writer.writeheader()
        writer.writerows(votes + votes_b)
    for key in (a / "key.json", b / "key.json"):
        assert run_command(PROG, main, ["--reveal", str(mixed), "--key", str(key)]) == 2
        printed = capsys.readouterr()
        assert printed.out == "" and len(printed.err.strip().splitlines()) == 1
        assert f"{mixed} mixes the votes of several sheets" in printed.err
        assert f"{key_a['sheet_id']} (from line 2), {key_b['sheet_id']} (from line 7)" in printed.err

    # A vote for a label the prompt does not have (two models: A and B), and a file that is not a key.
    fill_votes(a, ["A", "A", "C", "", ""])
    assert run_command(PROG, main, ["--reveal", str(a / "votes.csv")]) == 2
    assert "votes line 4: prompt_id '2' / preferred 'C' is not in the key (labels A, B)" in capsys.readouterr().err
    (tmp_path / "notakey.json").write_text('{"labels": [1, 2]}')
    assert run_command(PROG, main, ["--reveal", str(a / "votes.csv"), "--key", str(tmp_path / "notakey.json")]) == 2
    assert "notakey.json is not a compare key" in capsys.readouterr().err


def test_reveal_accepts_a_key_and_votes_from_before_sheet_ids_with_a_warning(tmp_path, monkeypatch, capsys):
    from jaxrl_llm.cli.compare import main
    from jaxrl_llm.cli.errors import run_command

    a = tmp_path / "a"
    key = write_sheet(a, PROMPTS_A, 0, monkeypatch)
    del key["sheet_id"]
    (a / "key.json").write_text(json.dumps(key))
    fill_votes(a, ["A", "B", "", "A", "A"])  # base, r5, -, r5, r5: base 1/4, r5 3/4
    capsys.readouterr()
    assert run_command(PROG, main, ["--reveal", str(a / "votes.csv")]) == 0
    printed = capsys.readouterr()
    assert printed.err.strip() == (
        f"{PROG}: warning: {a / 'key.json'} carries no sheet id (written before sheet ids, or the column was "
        f"dropped), so the votes cannot be matched to the key: make sure they are of the same sheet")
    assert re.search(r"base\s+0\.250  \[0\.000, 0\.674\]", printed.out)  # 0.25 +- 1.96 * sqrt(3/16 / 4)
    assert re.search(r"r5\s+0\.750  \[0\.326, 1\.000\]", printed.out)
    # Old votes too (only prompt_id, preferred): both files are named in the one warning line.
    (a / "old_votes.csv").write_text("prompt_id,preferred\n0,A\n1,B\n3,A\n4,A\n")
    assert run_command(PROG, main, ["--reveal", str(a / "old_votes.csv"), "--key", str(a / "key.json")]) == 0
    printed = capsys.readouterr()
    assert len(printed.err.strip().splitlines()) == 1
    assert f"{a / 'old_votes.csv'} and {a / 'key.json'} carry no sheet id" in printed.err
    assert re.search(r"base\s+0\.250", printed.out)

def test_compare_sheet_key_maps_back_exactly_and_the_judge_scores(run3, tiny_task, tmp_path, capsys):
    from jaxrl_llm.cli.compare import main
    from jaxrl_llm.cli.export import load_model
    from jaxrl_llm.config import DataSection
    from jaxrl_llm.data import build_prompt_set, load_records
    from jaxrl_llm.evaluation import generate_scored
    from jaxrl_llm.sampling import SamplingConfig

    models = [str(tiny_task / "model"), f"{run3}:1", f"{run3}:3"]
    out = tmp_path / "cmp"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((tiny_task / "test.jsonl").read_text().splitlines(keepends=True)[:8]))
    assert main(["--models", *models, "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8",
                 "--judge", "tests.cli.test_compare_report:parity", "--seed", "3"]) == 0
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
        writer.writerow(["prompt_id", "preferred", "sheet_id"])
        for p in range(8):
            writer.writerow([p, next(lab for lab, m in key["labels"][str(p)].items() if m == models[2]),
                             key["sheet_id"]])
    main(["--reveal", str(out / "votes.csv")])
    printed = capsys.readouterr().out
    assert re.search(rf"{re.escape(models[2])}\s+1.000  \[1.000, 1.000\]", printed)
    assert re.search(rf"{re.escape(models[0])}\s+0.000", printed)


def test_report_has_every_plot_and_every_image_loads_in_a_browser(run3, tmp_path):
    from jaxrl_llm.cli.report import PLOTS, expand_keys, load_run, main, sample_steps

    run = load_run(run3)
    for name, (_, _, left, right) in PLOTS.items():
        if name == "turns":  # multi-turn episodes only (tests/trainers/test_multi_turn.py checks it on one)
            continue
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
