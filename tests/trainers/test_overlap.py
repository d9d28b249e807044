"""Sampling beside training (`rollout.max_staleness`, `rollout.sampler_devices`; jaxrl_llm/trainers/overlap.py):
the staleness bound and its versions, the importance correction on stale rollouts, reproducibility, the sampler's
own mesh and its pushed weights, a kill and --resume with rollouts in flight, the checkpoint encoding, and the
settings that cannot work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import train
from jaxrl_llm.config import load_run_config
from jaxrl_llm.errors import ConfigError
from tests.runs import ROOT, read_rows, tiny_run, tiny_run_args
from tests.xla_settings import virtual_devices_xla_flags

pytestmark = pytest.mark.heavy(seconds=65)

VOLATILE = ("time/", "tokens_per_second")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _args(task: Path | None, out: Path, *extra: str) -> list[str]:
    # The default job's model and task (rewards that differ within a group); lr without warm-up, so every update
    # moves the policy and a stale rollout's log-probs differ
    return [*tiny_run_args(out), "steps=5", "optim.warmup_steps=0", "optim.learning_rate=3e-3",
            "eval_every=0", *extra]


@pytest.fixture(scope="module")
def stale_run(tiny_task, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stale") / "run"
    assert train.cli(_args(tiny_task, out, "rollout.max_staleness=1", "checkpoint_every=2",
                           "keep_checkpoints=3")) == 0
    return out


def test_every_rollout_is_at_most_k_versions_old_and_corrected(stale_run, tiny_task, tmp_path):
    rows = read_rows(stale_run, having="reward/mean")
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]  # step s sampled by version s - 2
    assert all(r["staleness/mean"] == r["staleness/max"] for r in rows)
    # token_truncate by default: the trainer recomputes the old log-probs and weights the loss by the ratio to the
    # sampler's; the version that sampled step 1 is the one it updates from, the later ones are an update behind.
    assert rows[0]["mismatch/logprob_abs_mean"] < 1e-5 and rows[0]["is_weight/mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(r["mismatch/logprob_abs_mean"] > 1e-3 for r in rows[1:])
    assert any(abs(r["is_weight/mean"] - 1.0) > 1e-4 for r in rows[1:])
    assert all(r["time/rollout_wait"] >= 0 for r in rows)

    sync = tmp_path / "sync"  # the same run synchronous: another trajectory from step 2 on
    assert train.cli(_args(tiny_task, sync, "rl.loss.rollout_correction=token_truncate")) == 0
    synced = read_rows(sync, having="reward/mean")
    assert "staleness/max" not in synced[0]
    assert synced[0]["loss"] == rows[0]["loss"]  # step 1 is the same on both
    assert all(r["mismatch/logprob_abs_mean"] < 1e-5 for r in synced)


def test_a_stale_run_is_reproducible_at_a_seed(stale_run, tiny_task, tmp_path):
    again = tmp_path / "again"
    assert train.cli(_args(tiny_task, again, "rollout.max_staleness=1", "checkpoint_every=2",
                           "keep_checkpoints=3")) == 0
    assert _stable(read_rows(again)) == _stable(read_rows(stale_run))


# Every collector the config can build (single-turn rows with or without dynamic sampling's refills, multi-turn
# episodes) at each staleness: synchronous, and sampled beside training. Episodes with refills are refused.
COLLECTORS = {
    "single-turn": (),
    "single-turn, dynamic sampling": ("rl.dynamic_sampling=true",),
    "multi-turn": ("env.name=tests.trainers.test_multi_turn:chatty",),
}


@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("collector", list(COLLECTORS))
def test_every_collector_runs_at_every_staleness(collector, staleness, tmp_path):
    """Each run takes its collector's own path at each staleness: the episodes' metrics (three turns each, the
    environment's tokens masked out of the loss) exactly on the multi-turn runs, the refill rounds exactly under
    dynamic sampling, and rollouts sampled a version behind exactly when K=1. (A multi-turn run with K=1 once
    took the single-turn staged path and died on the episodes' statistics: KeyError 'tool_calls'.)"""
    out = tmp_path / "run"
    assert train.cli(_args(None, out, "steps=3", f"rollout.max_staleness={staleness}", *COLLECTORS[collector])) == 0
    rows = read_rows(out, having="reward/mean")
    multi_turn, dynamic = collector.startswith("multi-turn"), "dynamic" in collector
    assert len(rows) == 3
    for r in rows:
        assert ("turns/mean" in r) == multi_turn and ("dynamic_sampling/refill_rounds" in r) == dynamic
        if multi_turn:  # the chatty environment ends each episode after its third turn, whatever the model says
            assert r["turns/mean"] == 3.0 and 0.0 < r["masked_tokens/frac"] < 1.0
    assert [r.get("staleness/max") for r in rows] == ([0.0, 1.0, 1.0] if staleness else [None] * 3)


@pytest.mark.parametrize("staleness", [0, 1])
def test_multi_turn_with_dynamic_sampling_is_a_one_line_refusal_at_every_staleness(staleness, tmp_path, capsys):
    args = _args(None, tmp_path / "run", f"rollout.max_staleness={staleness}", "rl.dynamic_sampling=true",
                 *COLLECTORS["multi-turn"])
    assert train.cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refilling groups is single-turn only" in err[0]
    assert not (tmp_path / "run").exists()


_KILL_AFTER_SAVE = textwrap.dedent("""
    import os, signal, sys
    import jaxrl_llm.run.checkpoint as ck
    import train

    original = ck.Checkpointer.save

    def save(self, step, state, meta):
        original(self, step, state, meta)
        if step == int(os.environ["KILL_AT_STEP"]):
            assert len(meta["in_flight"]) == 1, meta.keys()  # the rollout of the next step, sampled ahead
            self.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    ck.Checkpointer.save = save
    sys.exit(train.cli(sys.argv[1:]))
""")


def test_kill_and_resume_with_a_rollout_in_flight_continues_exactly(stale_run, tiny_task, tmp_path):
    out = tmp_path / "run"
    args = _args(tiny_task, out, "rollout.max_staleness=1", "checkpoint_every=2", "keep_checkpoints=3")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "KILL_AT_STEP": "2"}
    proc = subprocess.run([sys.executable, "-c", _KILL_AFTER_SAVE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert train.cli([*args, "--resume"]) == 0
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    # the resumed run consumed the stored rollout of step 3 (sampled by version 1) and kept the bound
    assert _stable(rows) == _stable(read_rows(stale_run))


_EVENTS: list[tuple[str, str]] = []  # (what, thread): the sampler's calls and the reward function's, in order
_SAMPLED = threading.Condition()


def slow_first_reward(prompts, completions, **fields):
    """A reward whose first call waits (up to a minute) for the next rollout to be sampled: it only returns early if
    the sampler samples while this rollout is scored."""
    _EVENTS.append(("score", threading.current_thread().name))
    if sum(e[0] == "score" for e in _EVENTS) == 1:
        with _SAMPLED:
            _SAMPLED.wait_for(lambda: sum(e[0] == "sample" for e in _EVENTS) >= 2, timeout=60.0)
    _EVENTS.append(("scored", threading.current_thread().name))
    return [float(len(c) % 2) for c in completions]


def test_rewards_run_while_the_next_rollout_is_sampled(tiny_task, tmp_path, monkeypatch):
    """K=1: the reward functions of step 1's rollout run in neither the sampler's thread nor the shell's, and step
    2's rollout is sampled before they return (the reward waits for it: were scoring in the sampler's way, it would
    wait its minute)."""
    from jaxrl_llm.trainers.policy import Policy

    sample = Policy.sample

    def recorded(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        with _SAMPLED:
            _EVENTS.append(("sample", threading.current_thread().name))
            _SAMPLED.notify_all()
        return out

    monkeypatch.setattr(Policy, "sample", recorded)
    _EVENTS.clear()
    config = tiny_run(None, tmp_path / "run", *_args(None, tmp_path / "run")[len(tiny_run_args(tmp_path / "run")):],
                      "steps=3", "rollout.max_staleness=1", "data.eval=", task=tiny_task,
                      rewards=[{"name": "tests.trainers.test_overlap:slow_first_reward"}])
    from jaxrl_llm.trainers import make_trainer

    make_trainer(config).run()
    order = [what for what, _ in _EVENTS]
    samples = [i for i, what in enumerate(order) if what == "sample"]
    # step 2 sampled before step 1's reward returned (whether the scorer started before or after that sampling)
    assert order[0] == "sample" and samples[1] < order.index("scored")
    assert {who for what, who in _EVENTS if what == "sample"} == {"jaxrl_llm-sampler"}
    assert not {who for what, who in _EVENTS if what == "score"} & {"jaxrl_llm-sampler", "MainThread"}
    assert order.count("scored") == 3


def test_rollouts_in_flight_round_trip_through_a_checkpoints_json():
    from jaxrl_llm.data import DataState
    from jaxrl_llm.sampling import SampleOutput
    from jaxrl_llm.trainers.base import Collected
    from jaxrl_llm.trainers.overlap import Sampled, decode_sampled, encode_sampled
    from jaxrl_llm.trainers.rollouts import Rollout

    rng = np.random.default_rng(0)
    out = SampleOutput(rng.integers(0, 9, (4, 3)).astype(np.int32), np.ones((4, 3), np.int32),
                       rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32),
                       np.full(4, 3, np.int32), np.array([True, False, True, True]))
    ro = Rollout(np.zeros((4, 2), np.int32), np.ones((4, 2), np.int32), out, rng.normal(size=4), {"r": np.ones(4)},
                 ["a", "b", "", "d"], np.array([3, 7]), conversations=[[{"role": "user", "content": "x"}]] * 4,
                 env_seconds=1.5)
    queued = [Sampled(3, 1, Collected(ro, DataState(1, 8), {"reward/mean": 0.25}, 12.0), 0.5)]
    back = decode_sampled(json.loads(json.dumps(encode_sampled(queued))))[0]
    assert (back.step, back.version, back.seconds) == (3, 1, 0.5)
    assert back.collected.data_state == DataState(1, 8) and back.collected.metrics == {"reward/mean": 0.25}
    b = back.collected.batch
    for got, want in zip(b.out, out, strict=True):
        if want is None:  # a dense model's routing record
            assert got is None
            continue
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.array_equal(b.rewards, ro.rewards) and b.completions == ro.completions
    assert b.conversations == ro.conversations and b.per_function["r"].tolist() == [1.0] * 4
    assert b.loss_mask is None and b.env_seconds == 1.5


_SPLIT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, "tests")
    from tests.runs import tiny_run_args
    from jaxrl_llm.config import load_run_config
    from jaxrl_llm.trainers import make_trainer

    task, out = sys.argv[1], sys.argv[2]
    config = load_run_config("configs/grpo_arithmetic.yaml", [*tiny_run_args(__import__("pathlib").Path(out)),
                                                            *sys.argv[3:]])
    trainer = make_trainer(config)
    algo, p = trainer.algorithm, trainer.algorithm.policy
    pushed = algo.sampler_weights(trainer.state)
    own = p.inference_weights(trainer.state["params"])
    pairs = list(zip(jax.tree.leaves(pushed), jax.tree.leaves(own)))
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    devices = sorted({d.id for x in jax.tree.leaves(pushed) for d in x.sharding.device_set})
    trainer_devices = sorted({d.id for x in jax.tree.leaves(own) for d in x.sharding.device_set})
    pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
    shared = any(pointer(a) == pointer(b) for a, b in pairs)
    split = any(x.addressable_shards[0].data.shape != x.shape for x in jax.tree.leaves(pushed))
    trainer.run()
    print(json.dumps({"same": same, "sampler": devices, "trainer": trainer_devices, "shared": shared,
                      "split": split}))
""")


def test_the_sampler_mesh_gets_the_trainers_weights_and_k0_is_the_one_mesh_run(tiny_task, tmp_path):
    """Two virtual devices split 1/1: the pushed weights equal the trainer's, on the other device, in buffers of
    their own; synchronous (K=0) on the split is the one-device run to the bit; K=1 on the split is the one-device
    K=1 run to the bit too."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": virtual_devices_xla_flags(2)}
    extra = ["steps=5", "optim.warmup_steps=0", "optim.learning_rate=3e-3", "eval_every=0"]
    for k in (0, 1):
        split = tmp_path / f"split{k}"
        proc = subprocess.run([sys.executable, "-c", _SPLIT, str(tiny_task), str(split), *extra,
                               "rollout.sampler_devices=1", f"rollout.max_staleness={k}"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        assert facts == {"same": True, "sampler": [1], "trainer": [0], "shared": False, "split": False}
        rows = read_rows(split, having="reward/mean")
        assert all(r["time/weight_sync"] >= 0 for r in rows[:-1 - k])
        one = tmp_path / f"one{k}"
        assert train.cli(_args(tiny_task, one, f"rollout.max_staleness={k}")) == 0
        assert _stable(read_rows(split)) == _stable(read_rows(one))


def test_a_tensor_parallel_sampler_mesh_gets_split_weights_and_samples(tiny_task, tmp_path):
    """Three virtual devices, the sampler's two tensor-parallel (`rollout.sampler_tensor=2`): the pushed weights
    equal the trainer's and are split over devices 1 and 2; the K=1 run samples on them within its staleness."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": virtual_devices_xla_flags(3)}
    out = tmp_path / "tp"
    proc = subprocess.run([sys.executable, "-c", _SPLIT, str(tiny_task), str(out), "steps=4", "eval_every=0",
                           "rollout.sampler_devices=2", "rollout.sampler_tensor=2", "rollout.max_staleness=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts == {"same": True, "sampler": [1, 2], "trainer": [0], "shared": False, "split": True}
    rows = read_rows(out, having="reward/mean")
    assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]
    assert all(np.isfinite(r["loss"]) and 0.0 <= r["reward/mean"] <= 1.0 for r in rows)


def test_settings_that_cannot_work_are_one_line_errors(tiny_task, tmp_path):
    from jaxrl_llm.trainers import check_devices, validate

    def config(*extra: str, **fields):
        return tiny_run(None, tmp_path / "x", *extra, task=tiny_task, **fields)

    assert config("rollout.max_staleness=2").rl.loss.rollout_correction == "token_truncate"  # on by default
    assert config("rollout.max_staleness=2", "rl.loss.rollout_correction=sequence_mask").rl.loss \
        .rollout_correction == "sequence_mask"
    assert config().rl.loss.rollout_correction == "none"
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=1 with rl.loss.rollout_correction=none: .*"
                                          r"rollout.allow_uncorrected=true"):
        validate(config("rollout.max_staleness=1", "rl.loss.rollout_correction=none"))
    validate(config("rollout.max_staleness=1", "rl.loss.rollout_correction=none", "rollout.allow_uncorrected=true"))
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=2 with rl.loss.rollout_correction=recompute: "):
        validate(config("rollout.max_staleness=2", "rl.loss.rollout_correction=recompute"))
    with pytest.raises(ConfigError, match=r"with algo=ppo: PPO's advantages are GAE"):
        validate(config("rollout.max_staleness=1", algo="ppo"))
    with pytest.raises(ConfigError, match=r"with algo=sft: it samples no rollouts"):
        validate(load_run_config(ROOT / "configs" / "sft_arithmetic.yaml", ["rollout.sampler_devices=1"]))
    with pytest.raises(ConfigError, match=r"rollout.sampler_devices=1: JAX sees 1 device\(s\) and the trainer "
                                          r"needs at least one"):
        check_devices(config("rollout.sampler_devices=1"))
    with pytest.raises(ConfigError, match=r"rollout.sampler_tensor=2 with rollout.sampler_devices=0: the sampler's "
                                          r"own devices must split into groups of 2"):
        check_devices(config("rollout.sampler_tensor=2"))
