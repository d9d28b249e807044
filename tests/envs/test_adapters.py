"""Environment libraries behind our interface: textarena's games played through `jaxrl_llm/envs/adapters.py`,
offline (the games here need no downloaded data and no LLM API)."""

from __future__ import annotations

import random
import re
import sys

import jax
import pytest

from tests.runs import tiny_run

ta = pytest.importorskip("textarena", reason="textarena is not installed (pip install 'jaxrl_llm[envs]')")

from jaxrl_llm.data import DataState  # noqa: E402  (after the skip: the module needs textarena)
from jaxrl_llm.envs.adapters import TextArenaEnvironment, record_seed  # noqa: E402
from jaxrl_llm.envs.base import resolve_environment  # noqa: E402
from jaxrl_llm.errors import ConfigError  # noqa: E402
from jaxrl_llm.trainers import make_trainer  # noqa: E402

GUESS = {"env_id": "GuessTheNumber-v0"}


def guess_the_number(record: dict, **kwargs) -> TextArenaEnvironment:
    return resolve_environment("textarena")(record, **{**GUESS, **kwargs})


def binary_search(env: TextArenaEnvironment, low: int = 1, high: int = 20) -> tuple[list[str], list]:
    """Plays GuessTheNumber by the game's hints; the moves and the StepResults."""
    moves, results = [], []
    while True:
        guess = (low + high) // 2
        moves.append(f"I guess [{guess}]")
        results.append(env.step(moves[-1]))
        if results[-1].done:
            return moves, results
        hint = results[-1].messages[0]["content"]
        low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)


def test_a_game_opens_with_its_prompt_and_binary_search_wins_it():
    env = guess_the_number({"prompt": "ignored", "seed": 3})
    opening = env.reset()
    assert [m["role"] for m in opening] == ["user"]
    assert "Guess The Number" in opening[0]["content"] and "between 1 and 20" in opening[0]["content"]
    moves, results = binary_search(env)
    assert 1 <= len(moves) <= 5  # log2(20) guesses, within the game's 10 turns
    for r in results[:-1]:
        assert not r.done and r.reward == 0.0
        assert re.fullmatch(r"The target number is (higher|lower)\.", r.messages[0]["content"])  # not our move
    last = results[-1]
    assert last.done and last.messages == [] and last.reward == 1.0  # textarena's reward for a win
    assert "Congratulations" in last.info["reason"] and not last.info["invalid_move"]


def test_an_invalid_move_gets_the_games_notice_and_a_second_one_ends_the_game():
    env = guess_the_number({"seed": 3})
    env.reset()
    first = env.step("a number, I think")
    assert not first.done and "invalid move" in first.messages[0]["content"]
    assert "[number]" in first.messages[0]["content"]  # the game's own feedback, for the model to read
    second = env.step("still no number")
    assert second.done and second.info["invalid_move"] and second.reward == 0.0  # no guess yet: 0% complete


def test_the_same_record_plays_the_same_game_and_other_seeds_other_games():
    def secret(record: dict) -> int:
        env = guess_the_number(record)
        env.reset()
        return env.game.state.game_state["game_number"]

    record = {"prompt": "p", "answer": "1"}
    random.seed(0)
    outer = random.random()
    random.seed(0)
    secrets = {secret(record) for _ in range(4)}
    assert len(secrets) == 1 and random.random() == outer  # and the process's own `random` is left alone
    assert record_seed(record) == record_seed(dict(reversed(record.items())))  # a hash of the content
    assert len({secret({"seed": s}) for s in range(12)}) > 1
    a, b = guess_the_number({"seed": 5}), guess_the_number({"seed": 5})
    assert a.reset() == b.reset()
    assert binary_search(a)[1] == binary_search(b)[1]


def test_a_record_names_its_own_game_and_settings_reach_the_game():
    env = resolve_environment("textarena")({"env_id": "TowerOfHanoi-v0", "seed": 0}, env_id="GuessTheNumber-v0")
    assert "Tower of Hanoi" in env.reset()[0]["content"]
    moved = env.step("[A C]")  # the smallest disk, a legal first move: the game answers with the board
    assert not moved.done and "C: [1]" in moved.messages[0]["content"]
    wide = guess_the_number({"seed": 0}, game_kwargs={"max_number": 1000})
    assert "between 1 and 1000" in wide.reset()[0]["content"]


def test_configuration_mistakes_and_library_failures_are_readable(monkeypatch):
    with pytest.raises(ConfigError, match="env.kwargs.env_id='NoSuchGame-v0' is not a textarena game"):
        resolve_environment("textarena")({}, env_id="NoSuchGame-v0")
    with pytest.raises(ConfigError, match="needs env.kwargs.env_id"):
        resolve_environment("textarena")({})
    env = guess_the_number({"seed": 1})
    env.reset()

    def crash(action: str):
        raise ValueError("the board\nis on fire")

    monkeypatch.setattr(env.game, "step", crash)
    result = env.step("[3]")
    assert result.done and result.messages == [] and result.reward == 0.0
    assert result.info == {"error": "textarena GuessTheNumber-v0 raised ValueError: the board is on fire"}
    monkeypatch.setitem(sys.modules, "textarena", None)  # as if not installed: the import raises ImportError
    with pytest.raises(ConfigError, match=r"env.name=textarena needs the textarena package: pip install"):
        guess_the_number({})


def test_a_tiny_model_plays_the_game_in_the_trainer(tiny_task, tmp_path):
    config = tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=", "env.name=textarena",
                      "env.kwargs={env_id: GuessTheNumber-v0}", "env.max_turns=2", task=tiny_task)
    trainer = make_trainer(config)
    collected = trainer.algorithm.collect(trainer.state, DataState(), jax.random.key(0))
    assert collected.metrics["turns/mean"] >= 1 and collected.metrics["env_errors/frac"] == 0.0
    conversations = collected.batch.conversations
    assert len(conversations) == 16  # rl.prompts_per_step=4 x rl.group_size=4, every one a game
    assert any(len(conversation) > 2 for conversation in conversations)  # some played a second turn
    for conversation in conversations:
        assert "Guess The Number" in conversation[0]["content"] and conversation[1]["role"] == "assistant"
        for message in conversation[2:]:  # what the game answered to a move the tiny model got to make
            assert message["role"] == "assistant" or "target number" in message["content"] \
                or "invalid move" in message["content"]
