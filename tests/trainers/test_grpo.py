"""GRPO end to end on tiny local models: finite metrics, checkpoint + resume, learning, data parallelism,
mu > 1 really moving the ratio, and the GSM8K preset on the shared data (mesh independence: test_sharding.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.data import DataState
from jaxrl_llm.errors import TrainingError
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.rl import PolicyLossOptions
from jaxrl_llm.sharding import make_mesh
from jaxrl_llm.trainers import make_trainer
from jaxrl_llm.trainers.objectives import PolicyObjective, policy_loss
from jaxrl_llm.trainers.step import jit_one_step_update, state_sharding
from tests.batches import fixed_update_setup
from tests.families import TINY
from tests.runs import GSM8K, STORIES260K, read_rows, requires_shared, tiny_run

pytestmark = pytest.mark.heavy(seconds=24)


def _config(task: Path, out: Path, *overrides: str):
    return tiny_run("grpo_arithmetic", out, *overrides, task=task)


# math_answer (whose metric names the test checks) plus a reward with variance, so the policy surely moves.
TWO_REWARDS = "rewards=[{name: math_answer}, {name: 'tests.runs:completion_length'}]"


def test_short_run_writes_metrics_checkpoints_and_resumes(tiny_task, tmp_path):
    out = tmp_path / "run"
    config = _config(tiny_task, out, "steps=3", "checkpoint_every=2", "rl.beta=0.04", "rl.mu=2",
                     "rl.minibatch_size=8", "sample_every=1", "tensorboard=true", TWO_REWARDS)
    summary = make_trainer(config).run()
    steps = read_rows(out, "reward/mean")
    assert [r["step"] for r in steps] == [1, 2, 3]
    for name in ("reward/mean", "reward/std", "reward/math_answer/mean", "kl", "clip_fraction/low",
                 "clip_fraction/high", "entropy", "policy_loss", "grad_norm", "learning_rate",
                 "completion_length/mean", "completion_length/max", "frac_truncated", "frac_zero_std_groups",
                 "tokens_per_second", "time/rollout", "time/update"):
        assert all(isinstance(r[name], float) and np.isfinite(r[name]) for r in steps), name
    # beta > 0: the reference model is used and the policy drifts from it.
    assert steps[-1]["kl"] > 0
    assert "eval/accuracy" in summary["before"] and "eval/accuracy" in summary["after"]
    assert (out / "samples.jsonl").read_text().count("\n") == 3 * 16
    assert list((out / "tensorboard").iterdir())
    ckpt = out / "checkpoints"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 3]

    # Resume: continues from step 3 with the saved params, optimizer state and data position.
    resumed = make_trainer(_config(tiny_task, out, "steps=5", "checkpoint_every=2", "rl.beta=0.04",
                                  "rl.mu=2", "rl.minibatch_size=8", "tensorboard=true", TWO_REWARDS), resume=True)
    assert resumed.step == 3
    assert resumed.data_state.position == 12  # 3 steps x 4 prompts
    first = make_trainer(_config(tiny_task, tmp_path / "fresh", "steps=3"))
    changed = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), resumed.state["params"], first.state["params"])
    assert max(jax.tree.leaves(changed)) > 0  # restored trained params, not the initial ones
    resumed.run()
    assert [r["step"] for r in read_rows(out, "reward/mean")] == [1, 2, 3, 4, 5]


def test_learnable_reward_rises(tiny_task, tmp_path):
    config = _config(tiny_task, tmp_path / "learn", "steps=30", "data.eval=''", "checkpoint_every=0",
                     "rewards=[{name: 'tests.runs:starts_with_seven'}]", "optim.learning_rate=1e-2",
                     "rl.group_size=8",
                     "sampling.max_new_tokens=3")
    make_trainer(config).run()
    rewards = [r["reward/mean"] for r in read_rows(tmp_path / "learn")]
    assert np.mean(rewards[:5]) < 0.3
    assert np.mean(rewards[-5:]) > 0.8, rewards


def test_mu_greater_than_one_moves_the_ratio_and_clipping_bites():
    """The old log-probs are kept: the 2nd update on the same rollout sees ratio != 1 and clips."""
    config, params, batch, optimizer = fixed_update_setup()
    state = {"params": params, "opt_state": optimizer.init(params)}
    objective = PolicyObjective(options=PolicyLossOptions(epsilon_low=0.1, epsilon_high=0.1))
    update = jit_one_step_update(make_mesh(), state_sharding(state), loss_fn=policy_loss, model_config=config,
                                 optimizer=optimizer, loss_config=objective, grad_accum=1)
    key = jax.random.key(0)
    state, m1 = update(state, batch, key, None)
    assert abs(float(m1["ratio/max"]) - 1) < 1e-5 and abs(float(m1["ratio/min"]) - 1) < 1e-5
    assert float(m1["clip_fraction"]) == 0.0
    state, m2 = update(state, batch, key, None)
    assert float(m2["ratio/max"]) > 1.1 or float(m2["ratio/min"]) < 0.9
    assert float(m2["clip_fraction"]) > 0


def test_nan_stops_the_step_not_the_checkpoints(tiny_task, tmp_path):
    """Non-finite gradients skip the update (params unchanged); persistent NaNs stop the run with an error
    that points at the intact checkpoints."""
    out = tmp_path / "nan"
    trainer = make_trainer(_config(tiny_task, out, "steps=2", "checkpoint_every=1", "data.eval=''"))
    trainer.run()
    poisoned = _config(tiny_task, out, "steps=20", "checkpoint_every=1", "data.eval=''")
    trainer = make_trainer(poisoned, resume=True)
    before = jax.tree.map(np.asarray, trainer.state["params"])
    real_update = trainer.algorithm.update

    def nan_update(state, ro, step, key):
        ro.rewards[:] = np.nan  # a reward pipeline that produced NaNs -> NaN advantages -> NaN loss
        return real_update(state, ro, step, key)

    trainer.algorithm.update = nan_update
    with pytest.raises(TrainingError, match="non-finite gradients"):
        trainer.run()
    after = jax.tree.map(np.asarray, trainer.state["params"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] >= 2


@requires_shared(GSM8K)
@requires_shared(STORIES260K)
def test_gsm8k_preset_runs_with_a_tiny_local_model(tmp_path):
    """The real-user preset, pointed at a tiny local Qwen2 (stories260K's tokenizer + a chat template)."""
    import shutil

    model_dir = tmp_path / "tiny-qwen2"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        if (STORIES260K / name).exists():
            shutil.copy(STORIES260K / name, model_dir / name)
    (model_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    config = config_from_hf({**TINY, "model_type": "qwen2", "vocab_size": 512, "eos_token_id": 2,
                             "max_position_embeddings": 1024})
    save_hf_model(init_params(config, jax.random.key(0)), config, model_dir)
    config = tiny_run("grpo_gsm8k_qwen2.5-0.5b", tmp_path / "run", f"model.path={model_dir}",
                      f"data.train={GSM8K / 'train.jsonl'}", f"data.eval={GSM8K / 'test.jsonl'}", "steps=2",
                      "rl.prompts_per_step=2", "rl.group_size=2", "sampling.max_new_tokens=8", "rl.minibatch_size=4",
                      "rl.grad_accum=2", "eval_size=4", "eval_batch_size=4", "checkpoint_every=0",
                      "model.dtype=float32", "model.param_dtype=float32")
    trainer = make_trainer(config)
    assert trainer.algorithm.collector.prompts.num_dropped > 0  # long GSM8K questions are dropped and counted
    assert "assistant:" in trainer.algorithm.collector.prompts.texts[0]  # chat template applied
    trainer.run()
    assert [r["step"] for r in read_rows(tmp_path / "run", "reward/mean")] == [1, 2]


def reward_depends_on_prompt_parity(prompts, completions, **fields):
    """Zero-variance groups for prompts whose first operand is even (always 0), informative otherwise."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        odd = int(prompt.split("+")[0]) % 2 == 1
        out.append(float(odd and completion.startswith(("1", "2", "3", "4", "5"))))
    return out


def test_dynamic_sampling_refills_the_batch_with_informative_groups(tiny_task, tmp_path):
    config = _config(tiny_task, tmp_path / "dyn", "steps=1", "data.eval=''", "checkpoint_every=0",
                     "rewards=[{name: 'tests.trainers.test_grpo:reward_depends_on_prompt_parity'}]", "rl.group_size=8",
                     "rl.prompts_per_step=8", "rl.dynamic_sampling=true", "rl.max_refill_rounds=6")
    trainer = make_trainer(config)
    ro, _, rounds = trainer.algorithm.collector.collect(trainer.state["params"], DataState(), jax.random.key(0))
    grouped = ro.rewards.reshape(8, 8)
    assert rounds >= 1  # about half the groups are zero-variance by construction, so refills were needed
    assert (grouped.std(axis=1) > 0).all()
    assert ro.prompt_tokens.shape[0] == 64 and ro.out.tokens.shape == (64, config.sampling.max_new_tokens)
    # Rows stay aligned: every kept prompt's first operand is odd.
    for i in ro.record_indices:
        assert int(trainer.algorithm.collector.prompts.records[i]["prompt"].split("+")[0]) % 2 == 1
    # The same rollout without dynamic sampling keeps the zero-variance groups.
    plain = make_trainer(_config(tiny_task, tmp_path / "plain", "steps=1", "data.eval=''", "checkpoint_every=0",
                                "rl.group_size=8", "rl.prompts_per_step=8",
                                "rewards=[{name: 'tests.trainers.test_grpo:reward_depends_on_prompt_parity'}]"))
    ro_plain, _, _ = plain.algorithm.collector.collect(plain.state["params"], DataState(), jax.random.key(0))
    assert (ro_plain.rewards.reshape(8, 8).std(axis=1) == 0).any()


@pytest.mark.parametrize("algo,extra", [("rloo", []), ("reinforce_pp", ["rl.beta=0.05", "rl.loss.kl_estimator=k1"]),
                                        ("grpo", ["rl.estimator=reinforce_pp_baseline", "rl.beta=0.05"])])
def test_other_estimators_run_on_the_same_loop(tiny_task, tmp_path, algo, extra):
    config = _config(tiny_task, tmp_path / algo, f"algo={algo}", "steps=2", "data.eval=''", "checkpoint_every=0",
                     *extra)
    trainer = make_trainer(config)
    # REINFORCE++ moves the KL into the token rewards, so the loss carries none.
    assert trainer.algorithm.objective.beta == (0.0 if algo == "reinforce_pp" else config.rl.beta)
    trainer.run()
    rows = read_rows(tmp_path / algo)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r[k]) for r in rows for k in ("policy_loss", "grad_norm", "advantages/abs_mean"))


def test_eval_reward_chooses_the_accuracy_check(tiny_task, tmp_path):
    """Held-out accuracy uses `eval_reward` when set (e.g. an exact-answer check while training on another
    reward), else the first training reward."""
    rewards = [{"name": "format", "kwargs": {"pattern": r"\d+"}}]
    summary = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "a", "checkpoint_every=0", "eval_reward=math_answer",
                                    task=tiny_task, rewards=rewards)).run()
    assert "eval/math_answer" in summary["after"] and "eval/format" not in summary["after"]
    default = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "b", "steps=0", "checkpoint_every=0", task=tiny_task,
                                    rewards=rewards))
    assert default.algorithm.evaluate(default.state, 4).keys() == {"eval/accuracy", "eval/format"}


@pytest.mark.parametrize("dtype,correction", [("float32", "recompute"), ("bfloat16", "sequence_mask"),
                                              ("bfloat16", "none")])
def test_rollout_correction_recomputes_and_weights(tiny_task, tmp_path, dtype, correction):
    """rl.loss.rollout_correction: `recompute` replaces the sampler's log-probs by the trainer's and logs the mismatch
    (float32: the two paths agree to rounding); the importance-weighting modes also log the weights; `none`
    (the sampler's log-probs, no extra pass) logs neither."""
    out = tmp_path / correction
    config = _config(tiny_task, out, "steps=2", "data.eval=''", "checkpoint_every=0", f"model.dtype={dtype}",
                     f"rl.loss.rollout_correction={correction}", TWO_REWARDS)
    make_trainer(config).run()
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    if correction == "none":
        assert not any(k.startswith(("mismatch/", "is_weight/")) for r in rows for k in r)
        return
    for r in rows:
        assert 0 <= r["mismatch/logprob_abs_mean"] <= r["mismatch/logprob_abs_max"]
        assert np.isfinite(r["mismatch/ratio_std"]) and np.isfinite(r["policy_loss"])
    if dtype == "float32":
        assert max(r["mismatch/logprob_abs_max"] for r in rows) < 1e-3
        assert not any(k.startswith("is_weight/") for k in rows[0])
    else:
        assert all(0 <= r["is_weight/masked_fraction"] <= 1 and r["is_weight/mean"] > 0 for r in rows)


def test_recompute_uses_the_train_steps_own_weights(tiny_task, tmp_path):
    """`rl.loss.rollout_correction=recompute` gives the old log-probs of the update's own forward: the master cast to
    `model.param_dtype` (here bf16), not the float32 master, so the first update's ratio is 1 up to rounding."""
    from jaxrl_llm.data import DataState
    from jaxrl_llm.models.weights import working_weights
    from jaxrl_llm.trainers.objectives import completion_logprobs

    config = _config(tiny_task, tmp_path / "rc", "steps=1", "data.eval=''", "checkpoint_every=0",
                     "model.dtype=float32", "model.param_dtype=bfloat16", "rl.loss.rollout_correction=recompute",
                     TWO_REWARDS)
    algo = make_trainer(config).algorithm
    p = algo.policy
    # off the bf16 grid, as the master is after any update (the loaded weights sit on it)
    state = algo.init()
    state["params"] = params = jax.tree.map(lambda x: x * (1 + 3e-3) + 1e-4, state["params"])
    ro = algo.collect(state, DataState(), jax.random.key(1)).batch
    weights = working_weights(params, p.model_config)
    sequences = ro.sequences()
    trainer_logp = completion_logprobs(weights, p.model_config, sequences, temperature=config.sampling.temperature)[0]
    master_logp = completion_logprobs(params, p.model_config, sequences, temperature=config.sampling.temperature)[0]
    seen = {}
    update_fn = algo.update_fn

    def spy(state, batch, *rest):
        seen["old"] = np.asarray(batch.old_logp)
        return update_fn(state, batch, *rest)

    algo.update_fn = spy
    algo.update(state, ro, 1, jax.random.key(2))
    mask = np.asarray(ro.out.mask, bool)
    assert np.abs(seen["old"] - np.asarray(trainer_logp))[mask].max() < 1e-5
    assert np.abs(np.asarray(master_logp) - np.asarray(trainer_logp))[mask].max() > 1e-4  # the test can tell them apart


@pytest.mark.parametrize(("overrides", "passes"), [
    (("rl.beta=0",), 0),  # no KL term: no reference model at all; mu = 1: the sampler's log-probs are the old ones
    (("rl.beta=0.04",), 1),  # the reference's pass only
    (("rl.beta=0.04", "rl.loss.rollout_correction=recompute"), 2),  # the old policy's recomputation too
])
def test_an_update_runs_only_the_log_prob_passes_its_math_needs(tiny_task, tmp_path, overrides, passes):
    """Whole-batch forward passes before the train step, counted on the GRPO update (one update a step, mu = 1)."""
    from jaxrl_llm.trainers.grpo import GRPOFamily

    algorithm = GRPOFamily(_config(tiny_task, tmp_path, "steps=1", "rl.mu=1", *overrides))
    calls = []
    inner = algorithm.ref_logprob_fn
    algorithm.ref_logprob_fn = lambda *a: calls.append(1) or inner(*a)
    state, key = algorithm.init(), jax.random.key(0)
    collected = algorithm.collect(state, DataState(), key)
    algorithm.update(state, collected.batch, 1, key)
    assert len(calls) == passes and (algorithm.ref_params is None) == (passes == 0)


def test_a_group_of_one_is_refused_exactly_when_the_estimator_compares_a_group(tmp_path):
    """GRPO's, RLOO's and the baselined REINFORCE++'s advantages compare a prompt's samples; REINFORCE++'s own
    does not, so a group of one runs with it under any `--algo` of the family."""
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.trainers import validate

    for algo, estimator, refused in (("grpo", "", True), ("rloo", "", True), ("reinforce_pp", "", False),
                                     ("grpo", "reinforce_pp", False), ("reinforce_pp", "rloo", True),
                                     ("reinforce_pp", "reinforce_pp_baseline", True)):
        config = tiny_run(None, tmp_path / "x", "rl.group_size=1", f"rl.estimator={estimator}", algo=algo)
        if refused:
            with pytest.raises(ConfigError, match=r"rl.group_size=1: a group-relative advantage needs at least 2"):
                validate(config)
        else:
            validate(config)
