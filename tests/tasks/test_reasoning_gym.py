"""reasoning-gym as a data source (`reasoning_gym:NAME?size=N&seed=S&OPTION=VALUE`) and a reward (`reasoning_gym`,
the task's own scorer): deterministic records, a held-out set on disjoint seeds, the scorer's 1 and 0, one-line
errors naming the key, the YAML preset through the normal config path, and a tiny run."""

from __future__ import annotations

import json
import sys

import pytest

from jaxrl_llm.data import load_records
from jaxrl_llm.errors import ConfigError, DataError
from jaxrl_llm.preflight import check_inputs, load_config, preflight
from jaxrl_llm.rewards import call_reward, resolve_reward
from jaxrl_llm.tasks import reasoning_gym as rgym
from tests.runs import read_rows, tiny_run

pytest.importorskip("reasoning_gym", reason="reasoning-gym is optional: pip install reasoning-gym")

CHAIN = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=2"


def fields_of(records):
    return {k: [r[k] for r in records] for k in records[0]}


def score(records, completions, **kwargs):
    fn = resolve_reward("reasoning_gym", kwargs)
    values, _ = call_reward("reasoning_gym", fn, [r["prompt"] for r in records], completions, fields_of(records))
    return values.tolist()


@pytest.mark.quick
def test_the_spec_generates_the_requested_records_deterministically():
    records, label = load_records(f"{CHAIN}&size=20&seed=7")
    again, _ = load_records(f"{CHAIN}&size=20&seed=7")
    assert len(records) == 20 and records == again
    assert label == "reasoning_gym:chain_sum[seeds 7..26]"
    other, _ = load_records(f"{CHAIN}&size=20&seed=8")
    assert other[0] == {**records[1], "reasoning_gym": f"{CHAIN}&size=20&seed=8",
                        "metadata": {**records[1]["metadata"], "source_index": 0}}  # entry i is made from seed+i
    first = records[0]
    assert set(first) == {"prompt", "question", "answer", "metadata", "reasoning_gym"}
    assert first["prompt"] == f"{first['question']}\n\n{rgym.INSTRUCTION}"
    assert first["metadata"]["source_dataset"] == "chain_sum"
    json.dumps(records)  # samples and exports can write them
    # the task's options reach its generator: two terms of at most two digits
    assert all(r["metadata"]["num_terms"] == 2 and r["metadata"]["num_digits"] <= 2 for r in records)
    bare, _ = load_records(f"{CHAIN}&size=2&instruction=")
    assert bare[0]["prompt"] == bare[0]["question"]
    assert load_records("reasoning_gym:chain_sum?size=3")[0][0]["reasoning_gym"] == "reasoning_gym:chain_sum?size=3"
    assert len(load_records("reasoning_gym:leg_counting")[0]) == rgym.DEFAULT_SIZE


@pytest.mark.quick
def test_held_out_seeds_are_disjoint_and_share_no_question():
    train_source = f"{CHAIN}&size=2000&seed=0"
    trained = {r["question"] for r in load_records(train_source)[0]}
    # other seeds, yet the same problems: chain_sum has only 200 of one digit, and the 2000 training ones hold them
    plain, _ = load_records(f"{CHAIN}&size=200&seed=1000000")
    assert 80 < len({r["question"] for r in plain} & trained) < 150
    held_out, label = load_records(f"{CHAIN}&size=200&seed=1000000", "test", held_out_from=train_source)
    assert len(held_out) == 200 and not {r["question"] for r in held_out} & trained
    assert held_out[0] == plain[0] if plain[0]["question"] not in trained else held_out[0] != plain[0]
    assert label == "reasoning_gym:chain_sum[seeds 1000000..1000427, 228 training problems skipped]"
    assert load_records(f"{CHAIN}&size=5&seed=9", held_out_from="train.jsonl")[0] == load_records(
        f"{CHAIN}&size=5&seed=9")[0]  # held out from a file: nothing skipped
    tiny = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&max_digits=1"  # 200 distinct problems in all
    with pytest.raises(DataError, match=r"^reasoning_gym:chain_sum\?.*&size=20&seed=5000: only \d+ of 400 entries .* "
                                        r"the task has too few distinct problems"):
        load_records(f"{tiny}&size=20&seed=5000", held_out_from=f"{tiny}&size=4000&seed=0")
    rgym.check_sources(f"{CHAIN}&size=2000&seed=0", f"{CHAIN}&size=200&seed=2000")  # adjacent ranges: fine
    rgym.check_sources(f"{CHAIN}&size=2000&seed=0", "reasoning_gym:leg_counting?size=10&seed=5")  # another task
    with pytest.raises(ConfigError) as info:
        rgym.check_sources(f"{CHAIN}&size=2000&seed=0", f"{CHAIN}&size=200&seed=1")
    assert str(info.value) == (f"data.eval={CHAIN}&size=200&seed=1: its seeds 1..200 overlap data.train's 0..1999 "
                               f"(entry i is made from seed+i), so the held-out set would repeat training "
                               f"problems: set seed=2000 or more in data.eval")
    # what the check prevents: shifted seeds repeat the same entries
    shifted, _ = load_records(f"{CHAIN}&size=200&seed=1")
    assert [r["question"] for r in shifted[:10]] == [r["question"] for r in load_records(train_source)[0][1:11]]


@pytest.mark.quick
@pytest.mark.parametrize("source", [CHAIN, "reasoning_gym:basic_arithmetic?max_terms=3", "reasoning_gym:leg_counting",
                                    "reasoning_gym:spell_backward", "reasoning_gym:letter_counting",
                                    "reasoning_gym:number_sorting?max_numbers=4"])
def test_the_reward_is_the_tasks_own_scorer(source):
    records, _ = load_records(f"{source}{'&' if '?' in source else '?'}size=6&seed=3")
    right = [f"Let me think.\n<answer>{r['answer']}</answer>" for r in records]
    assert score(records, right) == [1.0] * 6
    wrong = ["<answer>not the answer</answer>"] * 6
    assert score(records, wrong) == [0.0] * 6
    untagged = [str(r["answer"]) for r in records]  # reasoning-gym's convention: no tags, no answer
    assert score(records, untagged) == [0.0] * 6
    assert score(records, untagged, fallback="text") == [1.0] * 6


@pytest.mark.quick
def test_the_last_number_fallback_and_the_tag_come_first():
    records, _ = load_records(f"{CHAIN}&size=4&seed=11")
    answers = [r["answer"] for r in records]
    assert score(records, [f"{r['question']} {a}" for r, a in zip(records, answers, strict=True)],
                 fallback="last_number") == [1.0] * 4
    # a tagged answer is read from the tags even with a fallback
    assert score(records, [f"<answer>{a}</answer> and 12345" for a in answers], fallback="last_number") == [1.0] * 4
    assert score(records, ["no number here"] * 4, fallback="last_number") == [0.0] * 4
    with pytest.raises(Exception, match="fallback='last'"):
        score(records, ["1"] * 4, fallback="last")


@pytest.mark.quick
def test_the_reward_needs_reasoning_gym_records():
    with pytest.raises(Exception, match="reasoning_gym:NAME source .* no 'reasoning_gym' field"):
        call_reward("reasoning_gym", resolve_reward("reasoning_gym"), ["p"], ["<answer>1</answer>"], {"answer": ["1"]})


@pytest.mark.quick
@pytest.mark.parametrize(("source", "message"), [
    ("reasoning_gym:chain_summ", "reasoning-gym has no task 'chain_summ' (did you mean chain_sum"),
    ("reasoning_gym:chain_sum?max_digitz=2", "task chain_sum has no option 'max_digitz' (its options: min_terms, "),
    ("reasoning_gym:chain_sum?min_terms=5&max_terms=2", "task chain_sum refuses the options {'min_terms': 5, "
                                                         "'max_terms': 2}: AssertionError"),
    ("reasoning_gym:chain_sum?size=0", "size='0' must be a whole number >= 1"),
    ("reasoning_gym:chain_sum?seed", "'seed' is not key=value"),
    ("reasoning_gym:", "name a reasoning-gym task"),
])
def test_bad_specs_are_one_line_errors_naming_the_key(tmp_path, source, message):
    with pytest.raises(DataError) as info:
        load_records(source)
    assert str(info.value).startswith(f"{source}: {message}") and "\n" not in str(info.value)
    if source == "reasoning_gym:":
        return  # on the command line `data.train=reasoning_gym:` is a YAML mapping, which the config refuses
    config = tiny_run(None, tmp_path / "run", "model.path=unused", f"data.train={source}")
    with pytest.raises(ConfigError) as info:
        check_inputs(config)
    assert str(info.value).startswith(f"data.train={source}: {message}") and "\n" not in str(info.value)


@pytest.mark.quick
def test_without_the_package_the_error_says_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    monkeypatch.setattr(rgym, "_DATASETS", {})
    with pytest.raises(DataError, match=r"^reasoning_gym:chain_sum: the reasoning-gym package is not installed: "
                                        r"pip install reasoning-gym \(or pip install 'jaxrl_llm\[tasks\]'\)$"):
        load_records("reasoning_gym:chain_sum")
    config = tiny_run(None, tmp_path / "run", "model.path=unused", "data.train=reasoning_gym:chain_sum")
    with pytest.raises(ConfigError, match=r"^data.train=reasoning_gym:chain_sum: the reasoning-gym package is not "
                                          r"installed: pip install reasoning-gym"):
        check_inputs(config)


@pytest.mark.quick
def test_the_preset_loads_through_the_config_path(tiny_chat_model, tmp_path):
    preset = "configs/grpo_smollm2_reasoning_gym.yaml"
    overrides = [f"model.path={tiny_chat_model}", f"out_dir={tmp_path / 'run'}"]
    config = load_config(preset, overrides)
    options = "min_terms=2&max_terms=2&min_digits=2&max_digits=2"
    assert config.data.train == f"reasoning_gym:chain_sum?size=2000&seed=0&{options}"  # not made a path
    assert config.data.eval == f"reasoning_gym:chain_sum?size=200&seed=1000000&{options}"
    assert [(r.name, r.kwargs) for r in config.rewards] == [("reasoning_gym", {"fallback": "last_number"})]
    preflight(config, preset, overrides)
    overrides.append(f"data.eval=reasoning_gym:chain_sum?size=200&seed=1000&{options}")
    with pytest.raises(ConfigError, match=r"^data.eval=.*: its seeds 1000..1199 overlap data.train's 0..1999 .*"
                                          r"set seed=2000 or more in data.eval \(set on the command line\)$"):
        preflight(load_config(preset, overrides), preset, overrides)


def test_a_tiny_grpo_run_on_a_reasoning_gym_task(tiny_chat_model, tmp_path):
    from jaxrl_llm.trainers import make_trainer

    out = tmp_path / "run"
    config = tiny_run("grpo_smollm2_reasoning_gym", out, f"model.path={tiny_chat_model}", "steps=1",
                      "sampling.max_new_tokens=8", "data.max_prompt_tokens=240", "sample_every=1", "checkpoint_every=0",
                      f"data.train={CHAIN}&size=32&seed=0", f"data.eval={CHAIN}&size=16&seed=32")
    preflight(config)
    summary = make_trainer(config).run()
    assert [r["step"] for r in read_rows(out, "reward/mean")] == [1]
    assert {"eval/accuracy", "eval/reasoning_gym"} <= set(summary["before"]) & set(summary["after"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and "reward/reasoning_gym" in samples[0]
    assert samples[0]["prompt"].endswith("<|im_start|>assistant\n") and "<answer>" in samples[0]["prompt"]
