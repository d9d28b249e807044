"""Every input failure is one clear line: a YAML whose top level is not a mapping, the Python API's config
mapping (wrong types, unknown keys), reward functions that stall (a default time limit and a notice while
they run), and prompts longer than the tokenizer's model_max_length (no transformers warning besides the
project's own dropped count)."""

from __future__ import annotations

import inspect
import logging
import signal
import threading
import time

import pytest

import jaxrl_llm
import jaxrl_llm.rewards as rewards_module
import train
from jaxrl_llm.config import DataSection, RewardSpec, RunConfig, load_run_config, to_dict
from jaxrl_llm.data import build_preference_set, build_prompt_set
from jaxrl_llm.errors import ConfigError, RewardError
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.rewards import DEFAULT_TIMEOUT_S, REWARD_FUNCTIONS, call_reward, compute_rewards
from tests.runs import ROOT

pytestmark = pytest.mark.quick

TOP_LEVEL = "the top level must be a mapping of config sections (model:, data:, rl:, ...), not "

# ------------------------------------------------------------------------------ YAML top level


@pytest.mark.parametrize(("text", "kind"), [
    ("- model:\n    path: x\n- steps: 3\n", "a list"),
    ("42\n", "a number ('42')"),
    ("hello\n", "a string ('hello')"),
    ("true\n", "a boolean ('true')"),
])
def test_yaml_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(info.value) == f"{path}: {TOP_LEVEL}{kind}"


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "null\n", "~\n"])
def test_empty_yaml_is_the_defaults(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert to_dict(load_run_config(path)) == to_dict(load_run_config(None))


def test_yaml_syntax_error_still_names_the_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("rl:\n  beta: [\n")
    with pytest.raises(ConfigError, match=r"config\.yaml is not valid YAML: .*line 3"):
        load_run_config(path)


def test_yaml_list_through_train_py_is_one_line(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("- rl:\n    beta: 0.1\n")
    assert train.cli(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"train.py: error: {path}: {TOP_LEVEL}a list"]


def test_yaml_container_of_the_wrong_kind_names_the_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("rewards:\n  name: math_answer\n")  # a mapping where a list belongs
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(info.value) == (f"config key rewards in {path}: expected a list, got a mapping "
                               f"({{'name': 'math_answer'}})")


# ------------------------------------------------------------------------------ Python API's config


def _api_error(config: object, **kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        jaxrl_llm.train(config, **kwargs)
    assert type(info.value).__module__ == "jaxrl_llm.errors"  # never omegaconf's own exceptions
    message = str(info.value)
    assert "\n" not in message
    return message


def test_api_unknown_key_names_it_like_the_yaml(tmp_path):
    message = _api_error({"model": {"path": "x"}, "rl": {"betta": 1}})
    assert message.startswith("config key rl.betta in the Python API's config: Key 'betta' not in 'RLSection'")
    assert message.endswith("Did you mean: 'beta'?")
    path = tmp_path / "typo.yaml"
    path.write_text("rl:\n  betta: 1\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    # the same message, only the place differs
    assert str(info.value).replace(f"in {path}", "in the Python API's config") == message


def test_api_wrong_type_names_the_key():
    message = _api_error({"steps": "many"})
    assert message.startswith("config key steps in the Python API's config: Value 'many'")
    assert "Integer" in message


@pytest.mark.parametrize(("config", "expected"), [
    ({"rewards": {"name": "x"}}, "config key rewards in the Python API's config: expected a list, got a mapping "
                                 "({'name': 'x'})"),
    ({"rl": 3}, "config key rl in the Python API's config: expected a mapping of the section's fields, got a "
                "number (3)"),
    ({"rewards": ["math_answer"]}, "config key rewards[0] in the Python API's config: expected a mapping such as "
                                   "{name: math_answer}, got a string ('math_answer')"),
    ({"model": {"init": [1]}}, "config key model.init in the Python API's config: expected a mapping of keys to "
                               "values, got a list ([1])"),
    ({"grpo": {"beta": 0.1}}, "config key grpo in the Python API's config was renamed to rl (the RL loop's "
                              "section, for GRPO, RLOO, REINFORCE++ and PPO alike)"),
    ({1: 2}, "config key 1 in the Python API's config is not a string (int); config keys are field names such as "
             "'model' or 'steps'"),
    ({"steps": -1}, "steps=-1 must be >= 0 (set in the Python API's config)"),
])
def test_api_config_errors_are_one_line(config, expected):
    assert _api_error(config) == expected


def test_api_arguments_of_the_wrong_kind():
    assert _api_error(None, overrides="rl.beta=1") == \
        "overrides='rl.beta=1' must be a list of 'key=value' strings, e.g. ['rl.beta=0.04']"
    assert _api_error(None, reward_funcs=[len], reward_weights=["a"]) == "reward_weights[0]='a' must be a number"
    assert _api_error({"data": "x.jsonl"}, train_dataset=[{"prompt": "1+1="}]) == \
        "config key data in the Python API's config: expected a mapping of the section's fields, got a string " \
        "('x.jsonl')"


def test_command_line_containers_are_config_errors():
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["rewards={name: math_answer}"])
    assert str(info.value) == ("config key rewards on the command line ('rewards={name: math_answer}'): expected "
                               "a list, got a mapping ({'name': 'math_answer'})")
    with pytest.raises(ConfigError, match=r"^command-line override 'rewards=\[': the value is not valid YAML: "):
        load_run_config(None, ["rewards=["])


# ------------------------------------------------------------------------------ reward time limit


def test_reward_timeout_has_a_default_everywhere():
    assert DEFAULT_TIMEOUT_S == 300.0
    assert RewardSpec().timeout_s == DEFAULT_TIMEOUT_S
    assert inspect.signature(call_reward).parameters["timeout_s"].default == DEFAULT_TIMEOUT_S  # the eval path
    config = load_run_config(None, ["rewards=[{name: math_answer}, {name: format, timeout_s: 0}]"])
    assert [r.timeout_s for r in config.rewards] == [300.0, 0.0]  # 0 = no limit stays possible
    with pytest.raises(ConfigError, match=r"rewards\.0\.timeout_s=-1\.0 must be >= 0"):
        load_run_config(None, ["rewards=[{name: math_answer, timeout_s: -1}]"])
    assert isinstance(RunConfig().rewards, list)


def _sleepy(seconds: float):
    def sleepy(prompts, completions, **_):
        time.sleep(seconds)
        return [float(len(c)) for c in completions]

    return sleepy


def _notices(err: str, name: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"jaxrl_llm: reward function {name!r} has run")]


def test_slow_reward_prints_one_notice_and_still_returns(monkeypatch, capsys):
    monkeypatch.setattr(rewards_module, "NOTICE_AFTER_S", 0.2)
    values, seconds = call_reward("sleepy", _sleepy(0.9), ["p", "q"], ["a", "bcd"], {}, timeout_s=30)
    assert values.tolist() == [1.0, 3.0] and seconds >= 0.9
    notices = _notices(capsys.readouterr().err, "sleepy")
    assert notices == ["jaxrl_llm: reward function 'sleepy' has run for 0.2 s on 2 completions and not returned "
                       "yet (rewards[].timeout_s=30 s stops the run after that)"]  # once, not once per poll


def test_notice_names_the_default_limit_and_no_limit(monkeypatch, capsys):
    monkeypatch.setattr(rewards_module, "NOTICE_AFTER_S", 0.2)
    values, _ = call_reward("sleepy", _sleepy(0.5), ["p"], ["ab"], {})  # no timeout_s: the held-out evaluation's call
    assert values.tolist() == [2.0]
    assert "(rewards[].timeout_s=300 s stops the run after that)" in _notices(capsys.readouterr().err, "sleepy")[0]
    values, _ = call_reward("sleepy", _sleepy(0.5), ["p"], ["ab"], {}, timeout_s=0)
    assert values.tolist() == [2.0]
    assert _notices(capsys.readouterr().err, "sleepy")[0].endswith("(rewards[].timeout_s=0: no time limit)")
    total, each = compute_rewards([("sleepy", _sleepy(0.5), 2.0)], ["p"], ["abc"], {})  # no timeout_s entry
    assert total.tolist() == [6.0] and each["sleepy"].tolist() == [3.0]
    assert "timeout_s=300 s" in _notices(capsys.readouterr().err, "sleepy")[0]


def test_fast_reward_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(rewards_module, "NOTICE_AFTER_S", 0.2)
    call_reward("quick", _sleepy(0.0), ["p"], ["a"], {})
    call_reward("quick", _sleepy(0.0), ["p"], ["a"], {}, timeout_s=0)
    time.sleep(0.4)  # a timer that was not cancelled would print by now
    assert capsys.readouterr().err == ""


def test_stalled_reward_keeps_the_timeout_error(monkeypatch, capsys):
    monkeypatch.setattr(rewards_module, "NOTICE_AFTER_S", 0.2)
    with pytest.raises(RewardError) as info:
        call_reward("stalls", _sleepy(3.0), ["p"], ["a"], {}, timeout_s=0.5)
    assert str(info.value) == ("reward function 'stalls' did not return within rewards[].timeout_s=0.5 s "
                               "(1 completions); the run stops, its checkpoints are kept")
    assert len(_notices(capsys.readouterr().err, "stalls")) == 1


def test_signal_using_rewards_run_in_the_main_thread(monkeypatch, capsys):
    """math-verify installs SIGALRM handlers, which Python refuses off the main thread: under the default
    limit such a function still scores, in the caller's thread."""
    monkeypatch.setattr(rewards_module, "_MAIN_THREAD_ONLY", set())
    threads = []

    def alarmed(prompts, completions, **_):
        threads.append(threading.current_thread())
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
        return [1.0] * len(completions)

    assert call_reward("alarmed", alarmed, ["p"], ["a"], {})[0].tolist() == [1.0]
    assert call_reward("alarmed", alarmed, ["p"], ["a"], {})[0].tolist() == [1.0]
    assert threads[0] is not threading.main_thread() and threads[1:] == [threading.main_thread()] * 2
    err = capsys.readouterr().err
    assert err.count("jaxrl_llm: reward function 'alarmed' installs signal handlers") == 1
    values, _ = call_reward("math_verify", REWARD_FUNCTIONS["math_verify"], ["", ""],
                            ["The answer is $\\frac{1}{2}$", "The answer is $0.6$"], {"answer": ["0.5", "0.5"]})
    assert values.tolist() == [1.0, 0.0]


# ------------------------------------------------------------------------------ long prompts


@pytest.fixture
def transformers_warnings():
    """transformers' warnings as they reach a user (the suite runs with TRANSFORMERS_VERBOSITY=error)."""
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    handler = Collect()
    logging.getLogger("transformers").addHandler(handler)
    yield records
    logging.getLogger("transformers").removeHandler(handler)
    hf_logging.set_verbosity(old)


INDEXING_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


def _arith_tokenizer():
    tok = load_tokenizer(ROOT / "models" / "arith-base")
    assert tok.model_max_length == 64
    return tok


def test_dropped_long_prompt_prints_no_transformers_warning(transformers_warnings, capfd, caplog):
    long_prompt = "1+" * 50 + "1="  # BOS + 102 characters: longer than model_max_length=64
    records = [{"prompt": "1+1="}, {"prompt": long_prompt}, {"prompt": "1+" * 35 + "1="}]
    prompts = build_prompt_set(records, "mem", DataSection(max_prompt_tokens=80), _arith_tokenizer())
    assert prompts.num_dropped == 1  # the project's own count tells the user
    assert [len(ids) for ids in prompts.token_ids] == [5, 73]  # kept above model_max_length: not a limit here
    out, err = capfd.readouterr()
    assert INDEXING_WARNING not in err + out and INDEXING_WARNING not in caplog.text
    assert not any(INDEXING_WARNING in m for m in transformers_warnings)
    # the control: plain tokenization of the same prompt does warn, and this test would see it
    _arith_tokenizer()(long_prompt)
    assert any(INDEXING_WARNING in m for m in transformers_warnings)


def test_preference_pairs_print_no_transformers_warning(transformers_warnings, capfd):
    tok = _arith_tokenizer()
    records = [{"prompt": "1+1=", "chosen": "2" * 90, "rejected": "3"},
               {"prompt": "1+" * 50 + "1=", "chosen": "2", "rejected": "3"}]
    pairs = build_preference_set(records, "prefs", DataSection(max_prompt_tokens=32), tok, eos_id=2,
                                 max_response_tokens=128)
    assert pairs.num_dropped == 1 and len(pairs.chosen_ids[0]) == 91  # 90 characters + EOS, kept
    assert not any(INDEXING_WARNING in m for m in transformers_warnings)
    assert INDEXING_WARNING not in "".join(capfd.readouterr())
