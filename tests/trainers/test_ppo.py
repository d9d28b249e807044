"""PPO: the step's per-token rewards / GAE on a hand-made rollout, the critic (values, gradient, loading),
a few end-to-end steps on the tiny task with finite metrics, and resume with the critic and KL state."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, OptimSection
from jaxrl_llm.models.decoder import forward, init_params
from jaxrl_llm.models.heads import (
    critic_from_policy,
    critic_values,
    init_scalar_head,
    load_critic,
)
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.rl.estimators import ppo_targets, rollout_advantages, rollout_value_metrics
from jaxrl_llm.rl.kl_control import init_kl_controller, kl_controller_update
from jaxrl_llm.sharding import make_mesh
from jaxrl_llm.trainers import make_trainer
from jaxrl_llm.trainers.ppo import CriticBatch, ValueLossConfig, critic_loss, kl_controller_kind
from jaxrl_llm.trainers.step import jit_one_step_update, state_sharding
from tests.families import TINY
from tests.runs import read_rows, tiny_run

values_jit = jax.jit(critic_values, static_argnums=1)
forward_jit = jax.jit(forward, static_argnums=1, static_argnames="return_hidden")



def _config(task: Path, out: Path, *overrides: str):
    # PPO needs no groups: 8 prompts x 1 sample
    return tiny_run("ppo_arithmetic", out, "rl.prompts_per_step=8", "rl.group_size=1", "rl.minibatch_size=4",
                    *overrides, task=task)


# ------------------------------------------------------------------------------------ the hand-made rollout


def test_ppo_targets_on_a_hand_made_rollout():
    """Two sequences (3 and 2 valid tokens), kl_coef 0.1, gamma 0.9, lambda 0.5 (so gamma * lambda = 0.45)."""
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.int32)
    scores = np.array([1.0, 0.0], np.float32)
    old_logp = np.array([[-1.0, -0.5, -0.2], [-2.0, -1.0, -3.0]], np.float32)
    ref_logp = np.array([[-1.5, -0.5, -0.7], [-1.0, -1.2, -9.0]], np.float32)
    values = np.array([[0.5, 0.6, 0.8], [0.2, 0.1, 9.0]], np.float32)  # 9.0 sits on padding: ignored

    # k1 = old - ref:             row 0: [0.5, 0, 0.5]         row 1: [-1, 0.2, (pad) 0]
    # r_t = -0.1 * k1 + [last] * score:
    #                             row 0: [-0.05, 0, -0.05 + 1] row 1: [0.1, -0.02 + 0, 0]
    expected_kl = [[0.5, 0.0, 0.5], [-1.0, 0.2, 0.0]]
    expected_rewards = [[-0.05, 0.0, 0.95], [0.1, -0.02, 0.0]]
    # GAE backwards, V after the last token = 0:  delta_t = r_t + 0.9 V_{t+1} - V_t,  A_t = delta_t + 0.45 A_{t+1}
    # row 0: t=2  delta = 0.95 - 0.8                = 0.15    A = 0.15                         R = A + V = 0.95
    #        t=1  delta = 0 + 0.9 * 0.8 - 0.6       = 0.12    A = 0.12 + 0.45 * 0.15 = 0.1875   R = 0.7875
    #        t=0  delta = -0.05 + 0.9 * 0.6 - 0.5   = -0.01   A = -0.01 + 0.45 * 0.1875 = 0.074375  R = 0.574375
    # row 1: t=1  delta = -0.02 - 0.1               = -0.12   A = -0.12                        R = -0.02
    #        t=0  delta = 0.1 + 0.9 * 0.1 - 0.2     = -0.01   A = -0.01 + 0.45 * -0.12 = -0.064  R = 0.136
    expected_adv = [[0.074375, 0.1875, 0.15], [-0.064, -0.12, 0.0]]
    expected_returns = [[0.574375, 0.7875, 0.95], [0.136, -0.02, 0.0]]

    raw = ppo_targets(scores, old_logp, ref_logp, values, mask, 0.1, gamma=0.9, lam=0.5, whiten_advantages=False)
    np.testing.assert_allclose(raw.kl, expected_kl, atol=1e-6)
    np.testing.assert_allclose(raw.token_rewards, expected_rewards, atol=1e-6)
    np.testing.assert_allclose(raw.advantages, expected_adv, atol=1e-6)
    np.testing.assert_allclose(raw.returns, expected_returns, atol=1e-6)

    # Whitened over the 5 valid tokens: mean = (0.074375 + 0.1875 + 0.15 - 0.064 - 0.12) / 5 = 0.045575,
    # unbiased variance (ddof 1); padding stays 0. Returns are from the raw advantages.
    valid = np.array([0.074375, 0.1875, 0.15, -0.064, -0.12])
    assert abs(valid.mean() - 0.045575) < 1e-9
    white = (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
    step = jax.jit(lambda *a: ppo_targets(*a, gamma=0.9, lam=0.5, whiten_advantages=True))  # as the trainer does
    whitened = step(scores, old_logp, ref_logp, values, mask, jnp.float32(0.1))
    np.testing.assert_allclose(np.asarray(whitened.advantages)[mask > 0], white, atol=1e-5)
    assert float(whitened.advantages[1, 2]) == 0.0
    np.testing.assert_allclose(whitened.returns, expected_returns, atol=1e-6)

    metrics = rollout_value_metrics(raw, values, mask)
    np.testing.assert_allclose(metrics["kl"], (0.5 + 0 + 0.5 - 1 + 0.2) / 5, atol=1e-6)  # mean k1 per token
    np.testing.assert_allclose(metrics["values/mean"], (0.5 + 0.6 + 0.8 + 0.2 + 0.1) / 5, atol=1e-6)
    np.testing.assert_allclose(metrics["returns/mean"], np.mean([0.574375, 0.7875, 0.95, 0.136, -0.02]), atol=1e-6)
    np.testing.assert_allclose(metrics["token_reward/sum_mean"], (0.9 + 0.08) / 2, atol=1e-6)

    # gamma = lambda = 1, no KL: A_t = score - V_t (the return-to-go minus the value).
    plain = ppo_targets(scores, old_logp, ref_logp, values, mask, 0.0, gamma=1.0, lam=1.0, whiten_advantages=False)
    np.testing.assert_allclose(plain.advantages, [[0.5, 0.4, 0.2], [-0.2, -0.1, 0.0]], atol=1e-6)


def test_gae_is_the_registered_estimator_of_ppo_targets():
    """`rl.estimator=gae` (the registry entry validation names) gives PPO's whitened GAE advantages."""
    rng = np.random.default_rng(0)
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]])
    old, ref, values = (jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(3))
    scores = jnp.asarray([1.0, -0.5])
    expected = ppo_targets(scores, old, ref, values, mask, 0.1, gamma=0.9, lam=0.5).advantages
    got = rollout_advantages("gae", scores, mask, old, ref, group_size=1, beta=0.1, values=values, gamma=0.9, lam=0.5)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(got).max()) > 0.1
    with pytest.raises(ValueError, match="needs a critic's values"):
        rollout_advantages("gae", scores, mask, old, ref, group_size=1)


def test_kl_controller_fixed_and_adaptive():
    state = init_kl_controller(0.1)
    assert float(kl_controller_update(state, 0.5, 64, kind=kl_controller_kind(0.0)).coef) == pytest.approx(0.1)
    # KL / target - 1 = 4, clipped to 0.2: beta * (1 + 0.2 * 64 / 100)
    up = kl_controller_update(state, 0.5, 64, kind=kl_controller_kind(0.1), target=0.1, horizon=100.0)
    assert float(up.coef) == pytest.approx(0.1 * (1 + 0.2 * 0.64))
    # error -0.5 -> clipped to -0.2
    down = kl_controller_update(state, 0.05, 64, kind=kl_controller_kind(0.1), target=0.1, horizon=100.0)
    assert float(down.coef) == pytest.approx(0.1 * (1 - 0.2 * 0.64))


# ------------------------------------------------------------------------------------ the critic


def _fixed_rollout(config, n=8, p=5, t=4, seed=0):
    rng = np.random.default_rng(seed)
    pt = rng.integers(3, config.vocab_size, (n, p)).astype(np.int32)
    pm = np.ones((n, p), np.int32)
    pm[: n // 2, :2] = 0  # left padding
    pt[pm == 0] = 0
    ct = rng.integers(3, config.vocab_size, (n, t)).astype(np.int32)
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, n)[:, None]).astype(np.int32)
    return pt, pm, ct, cm


def test_critic_values_shape_zero_head_and_parity_with_a_full_forward():
    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(1))
    pt, pm, ct, cm = _fixed_rollout(config)
    critic = critic_from_policy(params, config)
    values = values_jit(critic, config, Sequences(pt, pm, ct, cm))
    assert values.shape == ct.shape and values.dtype == jnp.float32
    assert float(jnp.abs(values).max()) == 0.0  # zero head -> every value is 0

    # With a random head: V_t is the head applied to the hidden state of the position that predicts y_t.
    critic["value_head"] = init_scalar_head(config.hidden_size, jax.random.key(2), stddev=1.0)
    critic["value_head"]["bias"] = jnp.array([0.3])
    values = np.asarray(values_jit(critic, config, Sequences(pt, pm, ct, cm)))
    full = forward_jit(params, config, np.concatenate([pt, ct], 1), np.concatenate([pm, cm], 1), return_hidden=True)
    p = pt.shape[1]
    manual = np.asarray(full[:, p - 1 : -1] @ critic["value_head"]["kernel"])[..., 0] + 0.3
    np.testing.assert_allclose(values[cm > 0], manual[cm > 0], rtol=1e-5, atol=1e-5)
    # The critic's decoder is a copy: it shares no buffers with the policy.
    assert critic["decoder"]["embed"]["embedding"] is not params["embed"]["embedding"]


def test_critic_step_moves_values_toward_returns():
    """A few jitted, data-parallel critic updates on a fixed batch lower the (clipped) value loss."""
    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(1))
    pt, pm, ct, cm = _fixed_rollout(config)
    critic = critic_from_policy(params, config)
    returns = np.where(cm > 0, np.random.default_rng(3).uniform(0.0, 1.0, ct.shape), 0.0).astype(np.float32)
    old_values = np.zeros(ct.shape, np.float32)
    optimizer, _ = make_optimizer(OptimSection(learning_rate=3e-3), 20)
    state = {"params": critic, "opt_state": optimizer.init(critic)}
    update = jit_one_step_update(make_mesh(), state_sharding(state), loss_fn=critic_loss, model_config=config,
                                 loss_config=ValueLossConfig(clip_range=0.2), optimizer=optimizer, grad_accum=2)
    losses, fracs = [], []
    for _ in range(8):
        batch = CriticBatch(Sequences(pt, pm, ct, cm), old_values, returns)
        state, metrics = update(state, batch, jax.random.key(0), None)
        losses.append(float(metrics["value_loss"]))
        fracs.append(float(metrics["value_clip_fraction"]))
    assert losses[-1] < 0.7 * losses[0], losses
    assert fracs[0] == 0.0  # V = V_old at first: nothing clipped
    # The initial loss is 0.5 * mean over valid tokens of R^2 (V = 0).
    np.testing.assert_allclose(losses[0], 0.5 * np.mean(returns[cm > 0] ** 2), rtol=1e-5)
    values = np.asarray(values_jit(state["params"], config, Sequences(pt, pm, ct, cm)))
    err_before = np.abs(returns[cm > 0]).mean()
    assert np.abs(values - returns)[cm > 0].mean() < err_before


def test_load_critic_from_a_causal_lm_or_a_reward_model(tmp_path):
    """critic_init = a directory: a causal LM gives its decoder and a zero head; a HF reward model
    (LlamaForSequenceClassification) gives its decoder and score head, so V_0 = the RM's score of the prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = config_from_hf({**TINY, "vocab_size": 19})
    params = init_params(config, jax.random.key(4))
    save_hf_model(params, config, tmp_path / "lm")
    _, critic = load_critic(tmp_path / "lm")
    assert float(jnp.abs(critic["value_head"]["kernel"]).max()) == 0.0
    np.testing.assert_allclose(critic["decoder"]["embed"]["embedding"], params["embed"]["embedding"])

    hf = {k: v for k, v in TINY.items() if k != "model_type"}
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(**hf, vocab_size=19, num_labels=1, pad_token_id=0)).eval()
    rm.save_pretrained(tmp_path / "rm")
    rm_config, critic = load_critic(tmp_path / "rm")
    pt, pm, ct, cm = _fixed_rollout(rm_config, n=2)
    pm[:] = 1
    pt[:, :] = np.maximum(pt, 3)  # no padding: the RM scores the prompt's last token
    values = np.asarray(values_jit(critic, rm_config, Sequences(pt, pm, ct, np.ones_like(cm))))
    with torch.no_grad():
        scores = rm(input_ids=torch.tensor(pt, dtype=torch.long)).logits[:, 0].numpy()
    np.testing.assert_allclose(values[:, 0], scores, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def short_run(tiny_task, tmp_path_factory):
    """3 PPO steps: 1 critic warm-up step, adaptive KL (fast horizon), mu 2 x 2 minibatches, checkpoints."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    overrides = ("checkpoint_every=2", "rl.mu=2", "ppo.critic_warmup_steps=1", "ppo.kl_target=0.001",
                 "ppo.kl_horizon=100", "ppo.kl_coef_init=0.05", "optim.learning_rate=1e-3", "rl.entropy_coef=0.01",
                 "sample_every=1")
    trainer = make_trainer(_config(tiny_task, out, "steps=3", *overrides))
    summary = trainer.run()
    return out, overrides, trainer, summary, read_rows(out, "reward/mean")


def test_ppo_runs_end_to_end_with_finite_metrics(short_run):
    out, _, trainer, summary, steps = short_run
    assert [r["step"] for r in steps] == [1, 2, 3]
    for name in ("value_loss", "value_clip_fraction", "explained_variance", "returns/mean", "values/mean", "kl_coef",
                 "kl", "reward/mean", "critic/grad_norm", "advantages/abs_mean", "learning_rate", "time/update"):
        assert all(isinstance(r[name], float) and np.isfinite(r[name]) for r in steps), name
    # Step 1 warms up the critic only; afterwards the policy is updated too.
    assert "policy_loss" not in steps[0]
    for name in ("policy_loss", "grad_norm", "clip_fraction", "entropy", "approx_kl", "ratio/max"):
        assert all(np.isfinite(r[name]) for r in steps[1:]), name
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy has not moved yet
    assert steps[-1]["kl"] != 0.0
    assert steps[0]["values/mean"] == 0.0  # zero-initialised value head
    assert steps[1]["values/mean"] != 0.0  # the critic learned from step 1
    # The adaptive controller moves beta every step (KL is never exactly on target).
    assert steps[0]["kl_coef"] == pytest.approx(0.05)
    assert steps[1]["kl_coef"] != pytest.approx(0.05, rel=1e-6)
    assert trainer.algorithm.objective.beta == 0.0  # KL is in the reward, not the loss
    assert "frac_zero_std_groups" not in steps[0]  # group_size 1
    assert "eval/accuracy" in summary["before"] and "eval/accuracy" in summary["after"]
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]


def test_ppo_resumes_critic_and_kl_state(short_run, tiny_task):
    out, overrides, trainer, _, steps = short_run
    resumed = make_trainer(_config(tiny_task, out, "steps=4", "data.eval=''", *overrides), resume=True)
    assert resumed.step == 3 and resumed.data_state.position == trainer.data_state.position
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), (resumed.state["params"], resumed.state["critic"]),
                        (trainer.state["params"], trainer.state["critic"]))
    assert all(jax.tree.leaves(same))  # the trained policy and critic, not the initial ones
    assert float(resumed.state["kl_coef"]) == pytest.approx(float(trainer.state["kl_coef"]))
    assert float(resumed.state["kl_coef"]) != pytest.approx(0.05, rel=1e-6)
    opt_same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), resumed.state["critic_opt_state"],
                            trainer.state["critic_opt_state"])
    assert all(jax.tree.leaves(opt_same))
    resumed.run()
    assert [r["step"] for r in read_rows(out, "reward/mean")] == [1, 2, 3, 4]


def test_ppo_config_validation(tiny_task, tmp_path):
    with pytest.raises(ConfigError, match="ppo.lam"):
        _config(tiny_task, tmp_path, "ppo.lam=1.5")
    with pytest.raises(ConfigError, match="ppo.kl_estimator"):
        _config(tiny_task, tmp_path, "ppo.kl_estimator=k4")
