"""Data loading, reward functions and config validation: clear errors and hand-checked values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.data import DataError, DataState, build_prompt_set, next_batch_indices, read_jsonl
from jaxrl_llm.preflight import load_config
from jaxrl_llm.rewards import RewardError, compute_rewards, resolve_reward
from jaxrl_llm.rewards.math_answers import extract_answer, math_answer_reward, math_verify_reward
from jaxrl_llm.rewards.shaping import format_reward, overlong_reward
from jaxrl_llm.sampling.padding import left_pad
from jaxrl_llm.tasks.arithmetic import make_problems, make_tokenizer
from tests.runs import GSM8K, requires_shared

# ------------------------------------------------------------------------------------------------ data


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        read_jsonl(path)
    path.write_text('["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: expected a JSON object"):
        read_jsonl(path)


def test_missing_prompt_field_names_record(tmp_path):
    from jaxrl_llm.config import DataSection

    with pytest.raises(DataError, match=r"train\.jsonl:2: no 'prompt' field"):
        build_prompt_set([{"prompt": "1+1="}, {"question": "x"}], "train.jsonl", DataSection(), make_tokenizer())


def test_long_prompts_are_dropped_and_counted_not_cut():
    from jaxrl_llm.config import DataSection

    tok = make_tokenizer()
    records = [{"prompt": "1+1="}, {"prompt": "123456789+1="}, {"prompt": "22+3="}]
    # BOS + 4 chars = 5 tokens; BOS + 12 chars = 13 tokens
    prompts = build_prompt_set(records, "mem", DataSection(max_prompt_tokens=8), tok)
    assert prompts.num_dropped == 1
    assert [r["prompt"] for r in prompts.records] == ["1+1=", "22+3="]
    assert prompts.token_ids[0] == tok("1+1=")["input_ids"] and len(prompts.token_ids[0]) == 5


def test_templates_fill_from_fields():
    from jaxrl_llm.config import DataSection

    cfg = DataSection(prompt_template="Q: {question}\nA:", answer_template="{answer}")
    tok = make_tokenizer()
    with pytest.raises(DataError, match="needs field 'question'"):
        build_prompt_set([{"q": "1"}], "mem", cfg, tok)


def test_left_pad():
    tokens, mask = left_pad([[5, 6], [7], []], 3, pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 5, 6], [0, 0, 7], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1], [0, 0, 0]])


def test_batches_cover_each_epoch_once_and_resume_identically():
    state, seen = DataState(), []
    for _ in range(5):  # 5 batches of 4 over 10 records = 2 epochs
        idx, state = next_batch_indices(10, 4, state, seed=3)
        seen.append(idx)
    flat = np.concatenate(seen)
    assert sorted(flat[:10].tolist()) == list(range(10)) and sorted(flat[10:].tolist()) == list(range(10))
    assert state == DataState(epoch=2, position=0)
    # Resuming from a saved state continues with exactly the same prompts.
    _, mid = next_batch_indices(10, 4, DataState(), seed=3)
    again, _ = next_batch_indices(10, 4, mid, seed=3)
    np.testing.assert_array_equal(again, seen[1])


def test_arithmetic_problems_are_correct_and_distinct():
    problems = make_problems(500, seed=0, max_digits=3, ops="+-*")
    assert len({p["prompt"] for p in problems}) == 500
    for p in problems:
        assert int(p["answer"]) == eval(p["prompt"][:-1])  # noqa: S307 - our own generated arithmetic


@requires_shared(GSM8K)
def test_gsm8k_records_load_with_template():
    from jaxrl_llm.config import DataSection

    records = read_jsonl(GSM8K / "test.jsonl")[:20]
    cfg = DataSection(prompt_field="question", max_prompt_tokens=1000)
    prompts = build_prompt_set(records, "gsm8k", cfg, make_tokenizer())
    assert len(prompts) == 20
    assert math_answer_reward([], ["so the answer is #### " + records[0]["answer"].split("####")[-1]],
                              answer=[records[0]["answer"]]) == [1.0]


# --------------------------------------------------------------------------------------------- rewards


def test_extract_answer_forms():
    assert extract_answer("so 3 + 4 = 7\n#### 1,600") == "1,600"
    assert extract_answer("the result is \\boxed{\\frac{1}{2}} ok") == "\\frac{1}{2}"
    assert extract_answer("first 12 then 13.5") == "13.5"
    assert extract_answer("no digits") is None


def test_math_answer_reward_values():
    completions = ["579", "#### 1,600", "57", "answer: \\boxed{-3}", ""]
    answers = ["579", "Janet... #### 1600", "579", "-3", "1"]
    assert math_answer_reward([""] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_math_verify_reward_latex():
    out = math_verify_reward(["", ""], ["The answer is $\\frac{1}{2}$", "The answer is $0.6$"], answer=["0.5", "0.5"])
    assert out == [1.0, 0.0]


def test_format_and_overlong_rewards():
    assert format_reward([], ["<think>a</think><answer>3</answer>", "3"],
                         pattern=r"<think>.*</think><answer>.*</answer>") == [1.0, 0.0]
    # L_max = 10, buffer 4: threshold 6. L=5 -> 0; L=8 -> (6-8)/4 = -0.5; L=10 -> -1
    assert overlong_reward([], ["", "", ""], completion_lengths=[5, 8, 10], max_new_tokens=10,
                           buffer_tokens=4) == [0.0, -0.5, -1.0]


def bad_length(prompts, completions, **fields):
    return [1.0]


def raises(prompts, completions, **fields):
    raise KeyError("no_such_field")


def test_reward_errors_name_the_function():
    fields = {"answer": ["1", "2"]}
    with pytest.raises(RewardError, match="'tests.test_data_rewards_config:bad_length' returned 1 rewards for 2"):
        compute_rewards([("tests.test_data_rewards_config:bad_length",
                          resolve_reward("tests.test_data_rewards_config:bad_length"), 1.0)], ["a", "b"], ["1", "2"],
                          fields)
    with pytest.raises(RewardError, match="'boom' raised KeyError"):
        compute_rewards([("boom", raises, 1.0)], ["a", "b"], ["1", "2"], fields)
    with pytest.raises(RewardError, match="unknown reward function 'nope'"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot be imported"):
        resolve_reward("no_such_module_xyz:fn")


def test_weighted_sum_of_rewards():
    fns = [("math_answer", resolve_reward("math_answer"), 1.0),
           ("overlong", resolve_reward("overlong", {"buffer_tokens": 2}), 0.5)]
    total, each = compute_rewards(fns, ["", ""], ["12", "13"],
                                  {"answer": ["12", "12"], "completion_lengths": [3, 4], "max_new_tokens": 4})
    # overlong: threshold 2; L=3 -> -0.5, L=4 -> -1.0
    np.testing.assert_allclose(each["overlong"], [-0.5, -1.0])
    np.testing.assert_allclose(total, [1.0 - 0.25, 0.0 - 0.5])


# ---------------------------------------------------------------------------------------------- config


def test_config_overrides_and_type_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  group_size: 4\n  prompts_per_step: 2\n")
    c = load_config(path, ["rl.beta=0.04", "steps=3"])
    assert (c.rl.group_size, c.rl.beta, c.steps) == (4, 0.04, 3)
    with pytest.raises(ConfigError, match="rl.group_size"):
        load_config(path, ["rl.group_size=many"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_renamed_keys_name_their_new_names(tmp_path):
    """Configs written for earlier versions fail with the new key, from a YAML file or the command line."""
    old = tmp_path / "old.yaml"
    old.write_text("grpo:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match=r"config key grpo in .*old.yaml was renamed to rl"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"grpo.beta on the command line .* renamed to rl"):
        load_config(None, ["grpo.beta=0.04"])
    with pytest.raises(ConfigError, match=r"rl.ratio_level .* renamed to rl.policy_loss \(token -> ppo_clip"):
        load_config(None, ["rl.ratio_level=sequence"])
    # A run started by an earlier version (its config.yaml says grpo:, ratio_level) still resumes: the renamed
    # keys are read under their new names, so only real changes count.
    import yaml

    from jaxrl_llm.config import to_dict
    from jaxrl_llm.run.config_history import _current_names, config_changes

    current = load_config(None, ["rl.group_size=4"])
    written = to_dict(current)
    written["grpo"] = {k: v for k, v in written.pop("rl").items() if k != "policy_loss"}
    written["grpo"]["ratio_level"] = "token"
    old = _current_names(yaml.safe_load(yaml.safe_dump(written)))
    assert config_changes(old, to_dict(current)) == []
    old["rl"]["group_size"] = 8
    assert config_changes(old, to_dict(current)) == [("rl.group_size", 8, 4)]
    # The choices of the registries are the config's choices.
    assert load_config(None, ["rl.policy_loss=gspo"]).rl.policy_loss == "gspo"
    with pytest.raises(ConfigError, match="rl.policy_loss='clip': expected one of ppo_clip, gspo"):
        load_config(None, ["rl.policy_loss=clip"])
    with pytest.raises(ConfigError, match="rl.estimator=gae with algo=grpo: .* only --algo ppo has a critic"):
        load_config(None, ["rl.estimator=gae"])


def test_divisibility_is_checked_up_front(tmp_path):
    with pytest.raises(ConfigError, match=r"minibatch_size=6 must divide .* 2 \* 4 = 8"):
        load_config(None, ["rl.prompts_per_step=2", "rl.group_size=4", "rl.minibatch_size=6"])
    with pytest.raises(ConfigError, match="grad_accum=3 must divide"):
        load_config(None, ["rl.grad_accum=3"])
    with pytest.raises(ConfigError, match="rl.loss.aggregation='mean'"):
        load_config(None, ["rl.loss.aggregation=mean"])


def test_default_presets_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    from jaxrl_llm.trainers import ALGORITHMS

    presets = sorted(root.glob("*.yaml"))
    assert len(presets) >= 9
    for preset in presets:
        config = load_config(preset)  # raises ConfigError on a bad field or relation
        assert config.algo in ALGORITHMS and config.steps > 0, preset


def test_reward_fields_reach_functions(tmp_path):
    """Every record column reaches a user reward function as a keyword list."""
    seen = {}

    def capture(prompts, completions, **fields):
        seen.update(fields)
        return [0.0] * len(completions)

    compute_rewards([("capture", capture, 1.0)], ["p"], ["c"], {"answer": ["7"], "level": [3]})
    assert seen == {"answer": ["7"], "level": [3]}
    json.dumps(seen)
