"""`--algo distill` (jaxrl_llm/trainers/distill.py): GKD's loss and gradients against transformers' models and TRL's
formula, the teacher's log-probs wired to the sampled tokens (self-distillation is silent), the off-policy steps and
LoRA, and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import ConfigError
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.hf_export import hf_state_dict
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.preflight import load_config, preflight
from jaxrl_llm.trainers import make_trainer
from jaxrl_llm.trainers.distill import JSDObjective, jsd_loss
from jaxrl_llm.trainers.objectives import PolicyBatch
from tests.runs import QUIET, ROOT, read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=27)

STUDENT = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
               tie_word_embeddings=False)
# another size and shape, the same vocabulary: a teacher need not be the student's architecture
TEACHER = dict(STUDENT, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=3, tie_word_embeddings=True)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_loss_and_gradients_equal_torch(tmp_path, beta):
    """Two rows with different prompt and completion lengths: our jitted GKD loss and every parameter's gradient
    against transformers' models and TRL's `generalized_jsd_loss` written out in torch, row by row."""
    torch = pytest.importorskip("torch")
    from bench.common import random_hf_model

    student_t = random_hf_model(STUDENT, seed=0, eager=True, out_dir=tmp_path / "student")
    teacher_t = random_hf_model(TEACHER, seed=1, eager=True, out_dir=tmp_path / "teacher")
    config, params = load_hf_model(tmp_path / "student")
    teacher_config, teacher = load_hf_model(tmp_path / "teacher")
    prompts, completions = [[5, 9, 11], [7, 3, 20, 2, 8]], [[4, 6, 1], [12, 1]]
    pt = np.zeros((2, 5), np.int32)
    pm = np.zeros((2, 5), np.int32)
    ct = np.zeros((2, 4), np.int32)
    cm = np.zeros((2, 4), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        pt[i, 5 - len(p):], pm[i, 5 - len(p):] = p, 1
        ct[i, : len(c)], cm[i, : len(c)] = c, 1
    zeros = jnp.zeros(ct.shape, jnp.float32)
    batch = PolicyBatch(Sequences(jnp.asarray(pt), jnp.asarray(pm), jnp.asarray(ct), jnp.asarray(cm)), zeros, zeros,
                        jnp.zeros(2))
    objective = JSDObjective(teacher_config, beta=beta, temperature=0.8, logprob_block_mib=0.0)

    def loss_fn(p):
        return jsd_loss(p, batch, model_config=config, loss_config=objective, num_tokens=jnp.float32(5),
                        num_seqs=jnp.float32(2), frozen={"teacher": teacher})

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)

    def log_probs(model, prompt, completion):
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double() / 0.8
        return torch.log_softmax(logits, -1)

    total = 0.0
    for p, c in zip(prompts, completions, strict=True):
        ls = log_probs(student_t, p, c)
        with torch.no_grad():
            lt = log_probs(teacher_t, p, c)
        if beta == 0.0:
            jsd = torch.nn.functional.kl_div(ls, lt, reduction="none", log_target=True)
        elif beta == 1.0:
            jsd = torch.nn.functional.kl_div(lt, ls, reduction="none", log_target=True)
        else:  # TRL's GKDTrainer.generalized_jsd_loss
            b = torch.tensor(beta, dtype=ls.dtype)
            mix = torch.logsumexp(torch.stack([ls + torch.log(1 - b), lt + torch.log(b)]), dim=0)
            jsd = (b * torch.nn.functional.kl_div(mix, lt, reduction="none", log_target=True)
                   + (1 - b) * torch.nn.functional.kl_div(mix, ls, reduction="none", log_target=True))
        total = total + jsd.sum()
    torch_loss = total / 5  # batchmean over the 5 completion tokens
    torch_loss.backward()
    expected = float(torch_loss.detach())
    assert abs(float(loss) - expected) < 1e-5
    assert float(metrics["distill/jsd"]) == pytest.approx(expected, rel=1e-5)
    torch_grads = {n: p.grad.double().numpy() for n, p in student_t.named_parameters()}
    ours = dict(hf_state_dict(jax.tree.map(np.asarray, grads), config))
    assert set(ours) == set(torch_grads)
    for name, g in torch_grads.items():
        np.testing.assert_allclose(ours[name], g, atol=2e-5, rtol=0, err_msg=name)
    assert max(np.abs(g).max() for g in torch_grads.values()) > 1e-3


def distill_run(out: Path, *overrides: str):
    return tiny_run("distill_arithmetic", out, "steps=2", "rl.prompts_per_step=8", "rl.group_size=4",
                    "rl.minibatch_size=16", "eval_size=16", "eval_batch_size=16", "eval_every=0",
                    "model.dtype=float32", *QUIET, *overrides)


def test_reverse_kl_run_and_self_distillation_is_silent(tmp_path):
    """From the default task's base model: with the GRPO-trained teacher the per-token reverse KL is large and the
    advantages are its negatives; with the student itself as teacher it is ~0 (float32: only the sampler's and the
    trainer's rounding apart), so the teacher scores exactly the tokens the student sampled, where it sampled them."""
    make_trainer(distill_run(tmp_path / "teacher")).run()
    rows = read_rows(tmp_path / "teacher", "distill/reverse_kl")
    assert len(rows) == 2
    assert all(r["distill/reverse_kl"] > 0.05 for r in rows)
    assert all(r["distill/teacher_logp"] < 0 for r in rows)
    assert all(r["advantages/abs_mean"] > 0.05 for r in rows)

    make_trainer(distill_run(tmp_path / "self", f"distill.teacher={ROOT / 'models' / 'arith-base'}", "steps=1")).run()
    (row,) = read_rows(tmp_path / "self", "distill/reverse_kl")
    assert abs(row["distill/reverse_kl"]) < 1e-4
    assert row["advantages/abs_mean"] < 1e-4


def test_jsd_with_lora_takes_off_policy_steps(tmp_path):
    """GKD with LoRA adapters: the teacher rides beside the frozen base; lmbda = 1/2 gives steps on the data's
    answers (on_policy 0) and on the student's samples (1), and the JSD is positive and finite on both."""
    make_trainer(distill_run(tmp_path / "gkd", "distill.loss=jsd", "distill.lmbda=0.5", "lora.rank=4",
                             "steps=6")).run()
    rows = read_rows(tmp_path / "gkd", "distill/on_policy")
    assert {r["distill/on_policy"] for r in rows} == {0.0, 1.0}
    assert all(np.isfinite(r["distill/jsd"]) and r["distill/jsd"] > 0 for r in rows)
    off = [r for r in rows if r["distill/on_policy"] == 0.0]
    assert all(r["reward/mean"] == 1.0 for r in off)  # the data's answers are right


def test_gkd_beside_training_still_draws_the_datas_answers(tmp_path):
    """`rollout.max_staleness=1` with GKD at lmbda = 0: the sampling thread runs distillation's own collection, so
    every step trains on the data's answers, as the synchronous run does."""
    make_trainer(distill_run(tmp_path / "gkd", "distill.loss=jsd", "distill.lmbda=0", "steps=3",
                             "rollout.max_staleness=1")).run()
    rows = read_rows(tmp_path / "gkd", "distill/on_policy")
    assert [r["distill/on_policy"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]


def test_multi_turn_distillation_runs(tmp_path):
    """Episodes through the multi-turn collector (one-turn environment): the teacher's pass covers them."""
    make_trainer(distill_run(tmp_path / "mt", "env.name=single_turn", "steps=1")).run()
    (row,) = read_rows(tmp_path / "mt", "distill/reverse_kl")
    assert row["distill/reverse_kl"] > 0.05


def test_distill_errors_are_one_line(tmp_path, tiny_chat_model):
    config = ROOT / "configs" / "distill_arithmetic.yaml"
    with pytest.raises(ConfigError, match=r"^rl.beta=0.1 with distill.loss=jsd"):
        load_config(config, ["distill.loss=jsd", "rl.beta=0.1"])
    with pytest.raises(ConfigError, match=r"^distill.teacher is empty"):
        load_config(config, ["distill.teacher="])
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*nowhere: not found"):
        preflight(load_config(config, [f"distill.teacher={tmp_path / 'nowhere'}"]))
    c = load_config(config, [f"distill.teacher={tiny_chat_model}", f"out_dir={tmp_path / 'r'}", *QUIET])
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*tokenizer's vocabulary differs") as e:
        make_trainer(c)
    assert "\n" not in str(e.value)
