"""Environments from environment libraries, behind our interface (`base.py`).

`textarena` (https://github.com/LeonGuertler/TextArena, `pip install 'jaxrl_llm[envs]'`): its one-player text
games (GuessTheNumber, Mastermind, FrozenLake, TowerOfHanoi, Minesweeper, Sudoku, 2048, ...) as multi-turn
episodes. The model is player 0 and its turn's text is the move (the game finds the move in it, usually in
`[brackets]`); each turn's new game observations (the prompt and board at the start; hints, boards and
invalid-move notices after a move) are one user message; the game's reward, which textarena hands out when the
game ends, is the reward of the last turn.

    env:
      name: textarena
      kwargs: {env_id: GuessTheNumber-v0}   # or an `env_id` field in each record; game_kwargs: {...} to ta.make
      max_turns: 10

The game is seeded from the record (its `seed` field, else a hash of the record), so the G episodes of a GRPO
group play the same game and their rewards compare moves, not luck.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from jaxrl_llm.envs.base import Message, StepResult, register_environment
from jaxrl_llm.errors import ConfigError, one_line

# textarena games draw from the process-wide `random` (and a few from `numpy.random`), which its State seeds with
# `random.seed(seed)`. The trainer opens and steps episodes in a thread pool, so without this lock two episodes'
# draws would interleave and the same seed would not give the same game; each episode instead keeps its own
# generator states and swaps them in around every call into the library (games take microseconds a call).
_GLOBAL_RNG_LOCK = threading.Lock()
_NEXT_MOVE = "Your move."  # a turn the game answered with nothing new still needs a message, or the episode ends


def record_seed(record: dict[str, Any], seed_field: str = "seed") -> int:
    """The record's `seed_field`, else a hash of the record: stable across processes, unlike `hash()`."""
    if record.get(seed_field) is not None:
        return int(record[seed_field])
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class TextArenaEnvironment:
    """One textarena game played as player 0 (see the module docstring); `game` is the wrapped textarena env."""

    def __init__(self, ta: Any, env_id: str, seed: int, game_kwargs: dict[str, Any] | None = None) -> None:
        self.ta, self.env_id, self.seed = ta, env_id, seed
        self._python_rng = random.Random(seed).getstate()
        self._numpy_rng = np.random.RandomState(seed % 2**32).get_state()
        with self._own_rng():
            self.game = ta.make(env_id, **(game_kwargs or {}))
        # Observations are read from the game under its wrappers: its observation wrappers re-render the whole
        # history every turn, which the conversation already holds; its action wrappers (adding the brackets
        # around a bare move, say) still apply, since moves go through `self.game`.
        self._board = self.game
        while isinstance(self._board, ta.Wrapper):
            self._board = self._board.env

    @contextmanager
    def _own_rng(self) -> Iterator[None]:
        with _GLOBAL_RNG_LOCK:
            outer_python, outer_numpy = random.getstate(), np.random.get_state()
            random.setstate(self._python_rng)
            np.random.set_state(self._numpy_rng)
            try:
                yield
            finally:
                self._python_rng, self._numpy_rng = random.getstate(), np.random.get_state()
                random.setstate(outer_python)
                np.random.set_state(outer_numpy)

    def _observations(self) -> list[Message]:
        """The game's observations since the last call, as one user message; the echo of the model's own move
        is left out (the conversation has the model's turn)."""
        _, observations = self._board.get_observation()
        texts = [str(text) for _, text, kind in observations if getattr(kind, "name", "") != "PLAYER_ACTION"]
        return [{"role": "user", "content": "\n\n".join(texts) if texts else _NEXT_MOVE}]

    def reset(self) -> list[Message]:
        try:
            with self._own_rng():
                self.game.reset(num_players=1, seed=self.seed)
                return self._observations()
        except Exception as e:  # a multi-player game, a game whose data is missing: say which
            raise RuntimeError(f"textarena {self.env_id} cannot start as a one-player game: "
                               f"{type(e).__name__}: {one_line(e)[:300]}") from e

    def step(self, assistant_text: str) -> StepResult:
        try:
            with self._own_rng():
                done, _ = self.game.step(assistant_text)
                if not done:
                    return StepResult(self._observations(), 0.0, False, {})
                rewards, game_info = self.game.close()
        except Exception as e:  # the library's bug ends this episode, readably, not the run
            error = f"textarena {self.env_id} raised {type(e).__name__}: {one_line(e)[:300]}"
            return StepResult([], 0.0, True, {"error": error})
        player = (game_info or {}).get(0, {})
        info = {"reason": str(player.get("reason", "")), "invalid_move": bool(player.get("invalid_move", False))}
        return StepResult([], float((rewards or {}).get(0, 0.0)), True, info)


@register_environment("textarena")
def textarena_environment(record: dict[str, Any], *, env_id: str | None = None, seed_field: str = "seed",
                          game_kwargs: dict[str, Any] | None = None, tools: Any = ()) -> TextArenaEnvironment:
    """`env.name: textarena`: the game `env_id` (a record's own `env_id` field wins, for a mix of games), seeded
    by `record_seed`; `game_kwargs` override the registered game's settings (`{max_number: 50}`, say)."""
    try:
        import textarena as ta
    except ImportError as e:
        raise ConfigError("env.name=textarena needs the textarena package: pip install 'jaxrl_llm[envs]' "
                          f"(or pip install textarena) ({e})") from e
    if tools:
        raise ConfigError("env.tools: textarena games take moves as text, not tool calls; remove env.tools")
    env_id = record.get("env_id") or env_id
    if not env_id:
        raise ConfigError("env.name=textarena needs env.kwargs.env_id (e.g. GuessTheNumber-v0) or an `env_id` "
                          "field in each record")
    from textarena.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        raise ConfigError(f"env.kwargs.env_id={env_id!r} is not a textarena game (e.g. GuessTheNumber-v0, "
                          "Mastermind-v0, FrozenLake-v0, TowerOfHanoi-v0; see textarena.envs.registration)")
    return TextArenaEnvironment(ta, str(env_id), record_seed(record, seed_field), game_kwargs)
