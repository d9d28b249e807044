"""The train state's placement: each algorithm builds its jitted update from the parameters' shapes alone (no
optimizer state is made to read shardings from), and that placement is exactly the one `init()`'s state has."""

from __future__ import annotations

import jax
import pytest

import jaxrl_llm.sharding as sharding
from jaxrl_llm.trainers import algorithm_class, dpo, grpo, ppo, rm, sft
from jaxrl_llm.trainers.step import state_sharding
from tests.runs import tiny_run

pytestmark = pytest.mark.heavy(seconds=20)

PRESETS = {  # the GRPO family with the adaptive entropy controller, whose state is part of the train state
    "grpo": ("grpo_arithmetic", "rl.entropy_target=0.5"),
    "ppo": ("ppo_arithmetic", "rl.group_size=1"),
    "sft": ("sft_arithmetic",),
    "dpo": ("dpo_arithmetic",),
    "rm": ("rm_arithmetic",),
}


@pytest.mark.parametrize("algo", list(PRESETS))
def test_the_update_is_built_from_shapes_and_takes_inits_placement(algo, tmp_path, monkeypatch):
    made = []

    def counted(*args, **kwargs):
        made.append(1)
        return sharding.init_optimizer_state(*args, **kwargs)

    for module in (dpo, grpo, ppo, rm, sft):
        monkeypatch.setattr(module, "init_optimizer_state", counted)
    preset, *overrides = PRESETS[algo]
    config = tiny_run(preset, tmp_path / "run", *overrides)
    algorithm = algorithm_class(config.algo)(config)
    assert made == []  # the constructor built its update without an optimizer state
    state = algorithm.init()
    assert made  # init() makes it
    if hasattr(algorithm, "state_shardings"):  # the RL algorithms: their state has more than params and opt_state
        assert jax.tree.structure(algorithm.state_shardings()) == jax.tree.structure(state_sharding(state))
        assert algorithm.state_shardings() == state_sharding(state)
    else:
        p = algorithm.policy if hasattr(algorithm, "policy") else None
        params = state["params"]
        placed = sharding.train_state_shardings(algorithm.optimizer, params, state_sharding(params),
                                                p.mesh if p is not None else algorithm.mesh)
        assert placed == state_sharding(state)
    if algo == "grpo":
        assert set(state) == {"params", "opt_state", "entropy_controller"}
