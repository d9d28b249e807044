"""docs/environments.md as written: every YAML and Python file it shows runs on a small model, the environment's
reward alone trains (`rewards: []`), and the held-out evaluation of the guessing game follows the game's reward."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.envs.tool_formats import TOOL_FORMATS
from jaxrl_llm.envs.tools import call_tool, resolve_tools
from jaxrl_llm.preflight import load_config, preflight
from jaxrl_llm.trainers import make_trainer
from tests.runs import QUIET, ROOT, read_rows, read_summary

pytestmark = pytest.mark.heavy(seconds=27)

PAGE = ROOT / "docs" / "environments.md"
ARITH_BASE = ROOT / "models" / "arith-base"  # the default job's model: it answers the game's opening with a number
SMALL = ("steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "eval_size=4", "eval_batch_size=4",
         "sampling.max_new_tokens=8", "env.max_tokens=48", *QUIET)


@pytest.fixture(scope="module")
def page_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page's files, written as they are into one folder (the YAML files' folder, where their modules live)."""
    folder = tmp_path_factory.mktemp("environments_md")
    files = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```", PAGE.read_text(), re.S)
    assert sorted(name for name, _ in files) == ["guess.py", "guess.yaml", "my_tools.py", "my_tools.yaml",
                                                 "textarena.yaml", "tool_use.yaml"]
    for name, body in files:
        (folder / name).write_text(body)
    return folder


def games(folder: Path, name: str, secrets: list[int]) -> str:
    """A JSONL file of guessing-game records with these secrets."""
    path = folder / name
    path.write_text("".join(json.dumps({"prompt": "guess", "answer": str(s)}) + "\n" for s in secrets))
    return str(path)


def first_guess(conversation: list[dict]) -> int:
    """The number the doc's game reads from the model's first turn."""
    words = [w for w in conversation[1]["content"].replace(".", " ").split() if w.isdigit()]
    assert words, f"the model's first turn holds no number: {conversation[1]['content']!r}"
    return int(words[-1])


def test_the_guessing_game_trains_on_its_own_reward_and_eval_follows_it(page_files: Path) -> None:
    train = games(page_files, "train.jsonl", list(range(1, 101)))
    held_out = games(page_files, "test.jsonl", [10, 20, 30, 40])
    config = load_config(page_files / "guess.yaml", [f"model.path={ARITH_BASE}", f"data.train={train}",
                                                     f"data.eval={held_out}", f"out_dir={page_files / 'run'}", *SMALL])
    assert config.rewards == []  # as the page writes it: the environment's reward is the whole reward
    preflight(config)
    trainer = make_trainer(config)
    trainer.run()
    (row,) = read_rows(page_files / "run", "reward/mean")
    assert row["reward/env/mean"] == row["reward/mean"]  # the only reward there is
    summary = read_summary(page_files / "run")
    for when in ("before", "after"):
        metrics = summary[when]
        assert {"eval/accuracy", "eval/return", "eval/env"} <= set(metrics) and metrics["eval/return"] == \
            metrics["eval/env"]

    # The held-out metrics are the game's: secrets the model guesses at once are won, the others are not.
    evaluation, params = trainer.algorithm.evaluation, trainer.algorithm.policy.inference_weights(
        trainer.state["params"])
    episodes, _, _ = evaluation.play(params, evaluation.prompts, None)
    guesses = [first_guess(ep.conversation) for ep in episodes]
    for secrets, won in ((guesses, True), ([g % 100 + 1 for g in guesses], False)):  # the second: never the guess
        eval_file = games(page_files, "eval.jsonl", secrets)
        evaluation.prompts = trainer.algorithm.policy.prompt_set(eval_file, config.data.eval_split)
        metrics = evaluation(params, None)
        assert metrics["eval/return"] == metrics["eval/env"]
        if won:
            assert metrics["eval/accuracy"] == metrics["eval/env"] == 1.0 and metrics["eval/turns"] == 1.0
        else:  # every first guess is wrong: the game goes on, and the model does not win it here
            assert metrics["eval/accuracy"] < 1.0 and metrics["eval/env"] < 1.0 and metrics["eval/turns"] > 1.0


def test_without_an_environment_a_run_still_needs_a_reward(page_files: Path) -> None:
    train = games(page_files, "train.jsonl", [1, 2])
    config = load_config(None, [f"model.path={ARITH_BASE}", f"data.train={train}", "data.eval=", "rewards=[]"])
    with pytest.raises(ConfigError, match=r"algo=grpo needs rewards .*or an environment that rewards: env.name"):
        preflight(config)


def test_the_tool_use_and_textarena_configs_run_as_written(page_files: Path, tiny_task: Path) -> None:
    pytest.importorskip("textarena", reason="textarena is not installed (the test extra installs it)")
    for name in ("tool_use.yaml", "my_tools.yaml", "textarena.yaml"):
        out = page_files / f"run_{name.removesuffix('.yaml')}"
        config = load_config(page_files / name, [f"model.path={tiny_task / 'model'}",
                                                 f"data.train={tiny_task / 'train.jsonl'}", "data.eval=",
                                                 f"out_dir={out}", *SMALL])
        preflight(config)
        make_trainer(config).run()
        (row,) = read_rows(out, "reward/mean")
        assert row["turns/mean"] >= 1.0 and "env_errors/frac" in row, name


def test_the_pages_tool_answers_and_its_errors_reach_the_model(page_files: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    monkeypatch.syspath_prepend(str(page_files))
    tools = {t.name: t for t in resolve_tools(["calculator", "my_tools:DICTIONARY"])}
    calls, errors = TOOL_FORMATS["hermes"].parse('<tool_call>{"name": "dictionary", "arguments": {"word": "jax"}}'
                                                 '</tool_call><tool_call>{"name": "dictionary", "arguments": '
                                                 '{"word": "flax"}}</tool_call>', None)
    assert not errors
    assert call_tool(tools, calls[0]) == ("a Python library for accelerated array computing", True)
    assert call_tool(tools, calls[1]) == ("error: no entry for 'flax'", False)
