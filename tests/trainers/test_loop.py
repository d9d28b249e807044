"""The loop shell and the jitted update: `scanned_updates` equals the host loop of train steps it replaced,
the one metric reducer's rules, and `trainers.loop.Trainer` driving an algorithm written outside the package
(the contract of docs/extending.md: state, collect, update; checkpoint and resume by the shell)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.config import OptimSection
from jaxrl_llm.data import DataState, next_batch_indices
from jaxrl_llm.rl import PolicyLossOptions
from jaxrl_llm.sharding import make_mesh
from jaxrl_llm.trainers.base import Algorithm, Collected, Updated
from jaxrl_llm.trainers.loop import Trainer
from jaxrl_llm.trainers.objectives import PolicyObjective, policy_loss
from jaxrl_llm.trainers.step import reduce_metrics, scanned_updates, train_step
from tests.batches import fixed_update_setup
from tests.numerics import FLOAT32_UNIT_ROUNDOFF, assert_within_rounding
from tests.runs import read_rows, read_samples, tiny_run


def test_scanned_update_equals_the_host_loop_of_train_steps():
    """mu = 2 epochs x 2 minibatches of 4 rows in one jit (shuffle on the device) == the same permutations cut
    into minibatches on the host and one jitted train step each: same params, optimizer state and metrics."""
    config, params, batch, optimizer = fixed_update_setup()
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config,
                             loss_config=PolicyObjective(options=PolicyLossOptions(epsilon_low=0.1, epsilon_high=0.1)),
                             optimizer=optimizer,
                             grad_accum=1)
    key = jax.random.key(7)

    @jax.jit
    def scanned(params, opt_state, batch, key):
        def one(carry, minibatch):
            p, o, m = step(*carry, minibatch)
            return (p, o), m

        (p, o), reduced, stacked = scanned_updates(one, (params, opt_state), batch, key, epochs=2, minibatch_size=4)
        return p, o, reduced, stacked

    p_scan, o_scan, reduced, stacked = scanned(params, optimizer.init(params), batch, key)

    jit_step = jax.jit(step)
    p_host, o_host, history = params, optimizer.init(params), []
    for epoch in range(2):
        order = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), 8))
        for start in (0, 4):
            rows = order[start : start + 4]
            p_host, o_host, m = jit_step(p_host, o_host, jax.tree.map(lambda x, r=rows: np.asarray(x)[r], batch))
            history.append(m)
    # Four Adam steps amplify the float32 rounding of a differently fused program where a gradient entry is near
    # zero (Adam's step is ~ lr * g / |g|): up to 5e-5 here, depending on XLA's fusion choices; a wrong minibatch or
    # order moves the weights by about the learning rate (0.05), and the per-update losses below pin the order.
    for a, b in zip(jax.tree.leaves((p_scan, o_scan)), jax.tree.leaves((p_host, o_host)), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-4)
    assert stacked["policy_loss"].shape == (4,)
    np.testing.assert_allclose(stacked["policy_loss"], [h["policy_loss"] for h in history], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reduced["ratio/max"], max(float(h["ratio/max"]) for h in history), rtol=1e-6)
    np.testing.assert_allclose(reduced["clip_fraction"], np.mean([h["clip_fraction"] for h in history]), rtol=1e-5)
    assert float(reduced["ratio/max"]) > 1.05  # the later minibatches really were off-policy


def test_one_scanned_update_is_the_train_step_itself():
    """mu = 1 with the whole batch as the minibatch: `scanned_updates` runs the step once without a loop; the
    result is the jitted train step's on the rows in the key's order (same params, state, metrics)."""
    config, params, batch, optimizer = fixed_update_setup()
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config, loss_config=PolicyObjective(),
                             optimizer=optimizer, grad_accum=1)
    key = jax.random.key(3)

    @jax.jit
    def scanned(params, opt_state, batch, key):
        def one(carry, minibatch):
            p, o, m = step(*carry, minibatch)
            return (p, o), m

        return scanned_updates(one, (params, opt_state), batch, key, epochs=1, minibatch_size=8)

    (p_scan, o_scan), reduced, stacked = scanned(params, optimizer.init(params), batch, key)
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key, 0), 8))
    p_one, o_one, m = jax.jit(step)(params, optimizer.init(params), jax.tree.map(lambda x: np.asarray(x)[order], batch))
    # The two programs are fused differently, so their float32 sums round differently (bit-equal on some CPUs,
    # not on others). What must hold, with bounds from the arithmetic:
    # - the gradients (Adam's first moment after one step is (1 - b1) g) agree to the rounding of a sum over the
    #   batch's n = rows x positions tokens: |dg| <= 2 n u max|g|, u = 2^-24 (observed: <= 4 u max|g|);
    # - the params differ by exactly what that rounding does through Adam's direction d = m_hat / (sqrt(v_hat) + eps),
    #   which near g = 0 turns a relative error of the gradient into one of the step (lr = 0.05, so up to 5e-5 of
    #   a 1e-3 weight was seen): (p_scan - p_one) = -lr (d_scan - d_one), up to the two updates' own rounding.
    defaults = OptimSection()  # fixed_update_setup's AdamW: these betas, optax's eps, learning rate 0.05
    b1, b2, eps, lr, u = defaults.beta1, defaults.beta2, 1e-8, 0.05, FLOAT32_UNIT_ROUNDOFF
    s = batch.sequences
    tokens = s.prompt_tokens.size + s.completion_tokens.size - s.completion_tokens.shape[0]

    def moments(state: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return tuple([np.asarray(x, np.float64) for x in jax.tree.leaves(optax.tree_utils.tree_get(state, name))]
                     for name in ("mu", "nu"))

    def direction(mu: np.ndarray, nu: np.ndarray) -> np.ndarray:
        return (mu / (1 - b1)) / (np.sqrt(nu / (1 - b2)) + eps)

    (mu_scan, nu_scan), (mu_one, nu_one) = moments(o_scan), moments(o_one)
    leaves = zip(mu_scan, nu_scan, mu_one, nu_one, jax.tree.leaves(p_scan), jax.tree.leaves(p_one), strict=True)
    for ms, ns, mo, no, ps, po in leaves:
        g_scan, g_one = ms / (1 - b1), mo / (1 - b1)
        assert_within_rounding(g_scan, g_one, terms=tokens)
        moved = np.asarray(ps, np.float64) - np.asarray(po, np.float64)
        explained = -lr * (direction(ms, ns) - direction(mo, no))
        rounding = 2 * np.spacing(np.maximum(np.abs(ps), np.abs(po))) + 8 * u * lr  # each side: half a ulp, ~4 u of d
        np.testing.assert_array_less(np.abs(moved - explained), rounding)
    counters = [(a, b) for a, b in zip(jax.tree.leaves(o_scan), jax.tree.leaves(o_one), strict=True)
                if not jnp.issubdtype(a.dtype, jnp.floating)]  # steps taken, non-finite updates skipped
    assert counters and all(np.array_equal(a, b) for a, b in counters)
    assert stacked["policy_loss"].shape == (1,)
    np.testing.assert_allclose(reduced["policy_loss"], m["policy_loss"], rtol=1e-6)
    assert not np.allclose(jax.tree.leaves(p_scan)[0], jax.tree.leaves(params)[0])  # the step moved the weights


def test_reduce_metrics_rules():
    stacked = {"ratio/min": jnp.array([0.9, 0.8, 1.0]), "ratio/max": jnp.array([1.1, 1.3, 1.0]),
               "update_skipped": jnp.array([0.0, 1.0, 1.0]), "entropy": jnp.array([1.0, 2.0, 4.0]),
               "policy_loss": jnp.array([0.5, 0.25, 0.25])}
    out = {k: float(v) for k, v in reduce_metrics(stacked).items()}
    assert out["ratio/min"] == pytest.approx(0.8) and out["ratio/max"] == pytest.approx(1.3)
    assert out["update_skipped"] == 2.0 and out["last_update_skipped"] == 1.0
    assert out["entropy"] == pytest.approx(7 / 3) and out["policy_loss"] == pytest.approx(1 / 3)
    # Micro-batches: token-weighted means, losses summed (each is already normalised by the global count).
    micro = {k: float(v) for k, v in reduce_metrics(stacked, jnp.array([1.0, 1.0, 2.0]), sum_losses=True).items()}
    assert micro["entropy"] == pytest.approx((1 + 2 + 8) / 4) and micro["policy_loss"] == pytest.approx(1.0)


class CountingAlgorithm(Algorithm):
    """A minimal algorithm from outside the package: its 'model' is one counter in the state, incremented by the
    batch's sum each update; the shell owns the state and its checkpoints."""

    label = "count"
    collect_phase = "data"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mesh = make_mesh()
        self.vocab_size = 1
        self.seen: list[int] = []

    def init(self) -> dict[str, Any]:
        return {"total": jnp.zeros((), jnp.float32)}

    def describe(self) -> str:
        return "a counter"

    def collect(self, state: dict[str, Any], data_state: DataState, key: jax.Array) -> Collected:
        indices, data_state = next_batch_indices(10, 2, data_state, seed=0, shuffle=False)
        return Collected(indices, data_state, {"batch/first": float(indices[0])})

    def update(self, state: dict[str, Any], batch: np.ndarray, step: int, key: jax.Array) -> Updated:
        self.seen.extend(int(i) for i in batch)
        total = state["total"] + float(batch.sum())
        return Updated({"total": total}, {"loss": float(total), "update_skipped": 0.0})

    def evaluate(self, state: dict[str, Any], limit: int | None) -> dict[str, float]:
        return {"eval/total": float(state["total"])}

    def progress(self, metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["loss"]}

    def sample_rows(self, batch: np.ndarray) -> list[dict[str, Any]]:
        return [{"index": int(i)} for i in batch]

    def export(self, state: dict[str, Any], directory: Path) -> str:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "total.txt").write_text(str(float(state["total"])))
        return str(directory)


def test_the_shell_drives_an_outside_algorithm_and_resumes_it(tmp_path):
    def config(steps: int):
        return tiny_run(None, tmp_path / "run", f"steps={steps}", "checkpoint_every=2", "sample_every=1",
                        "data.eval=''", f"model.path={tmp_path / 'no_model'}", "export=true")

    straight = Trainer(tiny_run(None, tmp_path / "straight", "steps=5", "checkpoint_every=0",
                                f"model.path={tmp_path / 'no_model'}"), CountingAlgorithm)
    straight_summary = straight.run()
    assert straight.algorithm.seen == list(range(10))  # 5 steps x 2 examples, in data order

    first = Trainer(config(3), CountingAlgorithm)
    first.run()
    resumed = Trainer(config(5), CountingAlgorithm, resume=True)
    assert resumed.step == 3 and float(resumed.state["total"]) == float(first.state["total"])
    summary = resumed.run()
    assert resumed.algorithm.seen == list(range(6, 10))  # the data position came back with the checkpoint
    assert summary["after"] == straight_summary["after"] == {"eval/total": 45.0}
    steps = read_rows(tmp_path / "run", "loss")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in steps] == [1.0, 6.0, 15.0, 28.0, 45.0]
    assert all("time/data" in r and "time/update" in r for r in steps)  # the algorithm's collect phase name
    assert (tmp_path / "run" / "hf" / "total.txt").read_text() == "45.0"
    assert [s["index"] for s in read_samples(tmp_path / "run")] == list(range(10))
