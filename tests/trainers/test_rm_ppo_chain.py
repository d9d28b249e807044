"""The RLHF chain end to end on the tiny task: a reward model trained (Bradley-Terry) and exported, then PPO
whose training reward is that export (`configs/ppo_rm_arithmetic.yaml` with the paths swapped) and whose
critic starts from it. The rewards of the logged samples are recomputed from the exported classifier, so a
run rewarded by anything else (e.g. the exact-answer check) fails."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import load_run_config
from jaxrl_llm.models.reward_model import load_hf_reward_model, sequence_scores
from jaxrl_llm.models.tokenizer import load_tokenizer
from jaxrl_llm.tasks.arithmetic import make_preferences
from jaxrl_llm.trainers import make_trainer, train
from tests.runs import ROOT, read_rows, read_samples, tiny_run


@pytest.fixture(scope="module")
def chain(tiny_task, tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_ppo_chain")
    # Preference pairs (true answer over a wrong one) of the tiny task's own problems.
    pairs = make_preferences([json.loads(line) for line in (tiny_task / "train.jsonl").read_text().splitlines()],
                             seed=3)
    (root / "prefs_train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))

    # 1. --algo rm, a few steps, exported as a HF sequence classifier.
    rm_config = tiny_run("rm_arithmetic", root / "rm", f"data.train={root / 'prefs_train.jsonl'}", "data.eval=''",
                         "export=true", f"export_dir={root / 'rm' / 'hf'}", "steps=4", "sft.batch_size=16",
                         "eval_every=0", "optim.learning_rate=3e-3", "optim.warmup_steps=0", "log_every=1",
                         task=tiny_task, algo="rm")
    rm_summary = train(rm_config)
    rm_dir = Path(rm_summary["export"])

    # 2. --algo ppo with the preset, its reward model and critic swapped for the export.
    preset = ROOT / "configs" / "ppo_rm_arithmetic.yaml"
    ppo_config = tiny_run(preset.name, root / "ppo", f"ppo.critic_init={rm_dir}", "steps=2", "rl.mu=1",
                          "rl.minibatch_size=16", "sample_every=1", "checkpoint_every=0", task=tiny_task,
                          rewards=[{"name": "math_answer", "weight": 0.0},
                                   {"name": "reward_model", "weight": 1.0, "kwargs": {"path": str(rm_dir)}}])
    trainer = make_trainer(ppo_config)
    summary = trainer.run()
    return {"rm_dir": rm_dir, "rm_summary": rm_summary, "rm_rows": read_rows(root / "rm"),
            "trainer": trainer, "summary": summary, "steps": read_rows(root / "ppo", "reward/mean"),
            "samples": read_samples(root / "ppo"), "preset": load_run_config(preset, algo="ppo")}


def test_the_preset_trains_on_the_reward_model_only(chain):
    preset = chain["preset"]
    assert preset.algo == "ppo" and preset.ppo.critic_init == "runs/rm_arithmetic/hf"
    weighted = [(r.name, r.weight) for r in preset.rewards if r.weight != 0]
    assert weighted == [("reward_model", 1.0)]
    assert preset.rewards[0].name == "math_answer"  # the held-out evaluation scores with the first reward
    assert next(r for r in preset.rewards if r.name == "reward_model").kwargs["path"] == "runs/rm_arithmetic/hf"


def test_reward_model_trains_and_exports(chain):
    assert [r["step"] for r in chain["rm_rows"]] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in chain["rm_rows"])
    assert json.loads((chain["rm_dir"] / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]


def test_ppo_on_the_reward_model_has_finite_metrics(chain):
    steps = chain["steps"]
    assert [r["step"] for r in steps] == [1, 2]
    for name in ("reward/mean", "reward/reward_model/mean", "reward/math_answer/mean", "policy_loss", "value_loss",
                 "kl", "values/mean", "returns/mean", "explained_variance", "grad_norm", "critic/grad_norm"):
        assert all(np.isfinite(r[name]) for r in steps), name
    # The critic starts from the reward model (its score head), not from a zero head: values are not all 0.
    assert steps[0]["values/mean"] != 0.0
    # The held-out evaluation is the exact-answer accuracy (the first, weight-0 reward), before and after.
    for when in ("before", "after"):
        acc = chain["summary"][when]
        assert 0.0 <= acc["eval/accuracy"] <= 1.0 and "eval/math_answer" in acc


def test_the_training_reward_is_the_reward_models_score(chain):
    """Every logged step's reward is the RM's; each sample's reward equals the exported classifier's score
    of `prompt + completion`, recomputed here independently of the reward function."""
    for r in chain["steps"]:
        assert r["reward/mean"] == pytest.approx(r["reward/reward_model/mean"], abs=1e-6)
    samples = chain["samples"]
    assert len(samples) == 2 * 16 and {s["step"] for s in samples} == {1, 2}
    config, params, score = load_hf_reward_model(chain["rm_dir"])
    tokenizer = load_tokenizer(chain["rm_dir"])
    texts = [s["prompt"] + s["completion"] for s in samples]
    enc = tokenizer(texts, padding="longest", add_special_tokens=False, return_tensors="np")
    scores = jax.jit(sequence_scores, static_argnums=2)
    want = np.asarray(scores(params, score, config, jnp.asarray(enc["input_ids"]),
                             jnp.asarray(enc["attention_mask"])))[:, 0]
    got = np.asarray([s["reward"] for s in samples])
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(got, [s["reward/reward_model"] for s in samples], atol=1e-6)
    # Real-valued scores, not the exact-answer check's 0/1.
    assert not np.all(np.isin(got, (0.0, 1.0))) and np.std(got) > 0
