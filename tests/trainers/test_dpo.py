"""DPO (`--algo dpo`): the loss and its gradients against transformers' PyTorch model and the paper's formula,
TRL's metrics on a hand-made batch, chat-format pairs rendered with the template (DPO and the reward model),
reference log-probs computed in the step or precomputed (the same run), and the presets on tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.data import build_preference_set, pair_texts
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.hf_export import hf_state_dict
from jaxrl_llm.rl.preference import dpo_loss
from jaxrl_llm.trainers import make_trainer
from jaxrl_llm.trainers.dpo import DPOLossConfig, PairBatch, pair_batch, preference_loss
from tests.runs import ROOT, read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=16)

TINY_LLAMA = dict(model_type="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)


def test_dpo_loss_and_gradients_equal_torch(tmp_path):
    """One batch of two pairs (different prompt and response lengths, so padding matters): our jitted loss and
    every parameter's gradient against transformers' model and DPO's formula, computed pair by pair in torch."""
    torch = pytest.importorskip("torch")
    from bench.common import random_hf_model

    policy_t = random_hf_model(TINY_LLAMA, seed=0, eager=True, out_dir=tmp_path / "policy")
    ref_t = random_hf_model(TINY_LLAMA, seed=1, eager=True, out_dir=tmp_path / "ref")
    config, params = load_hf_model(tmp_path / "policy")
    _, ref_params = load_hf_model(tmp_path / "ref")
    prompts = [[5, 9, 11], [7, 3, 20, 2, 8]]
    chosen = [[4, 6, 1], [12, 1]]
    rejected = [[14, 1], [30, 31, 32, 1]]
    beta = 0.3

    from jaxrl_llm.data import PreferenceSet

    pairs = PreferenceSet(prompts, chosen, rejected, [{}, {}], 0)
    batch = pair_batch(pairs, np.arange(2), pad_id=0, prompt_bucket=4)
    loss_config = DPOLossConfig(loss="sigmoid", beta=beta, reference_in_step=True, logprob_block_mib=0.0)

    def loss_fn(p):
        loss, metrics = preference_loss(p, batch, model_config=config, loss_config=loss_config,
                                        num_tokens=jnp.float32(2), num_seqs=jnp.float32(2),
                                        frozen={"reference": ref_params})
        return loss, metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)

    def seq_logp(model, prompt, response):
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None]).sum()

    terms = []
    for p, w, l_ in zip(prompts, chosen, rejected, strict=True):
        with torch.no_grad():
            ref_margin = seq_logp(ref_t, p, w) - seq_logp(ref_t, p, l_)
        h = seq_logp(policy_t, p, w) - seq_logp(policy_t, p, l_) - ref_margin
        terms.append(-torch.nn.functional.logsigmoid(beta * h))  # Rafailov et al. 2023, eq. 7
    torch_loss = torch.stack(terms).mean()
    torch_loss.backward()
    assert abs(float(loss) - float(torch_loss)) < 1e-5
    assert float(metrics["rewards/accuracies"]) in (0.0, 0.5, 1.0)
    torch_grads = {n: p.grad.double().numpy() for n, p in policy_t.named_parameters()}
    ours = dict(hf_state_dict(jax.tree.map(np.asarray, grads), config))
    assert set(ours) == set(torch_grads)
    for name, g in torch_grads.items():
        np.testing.assert_allclose(ours[name], g, atol=1e-5, rtol=0, err_msg=name)
    assert max(np.abs(g).max() for g in torch_grads.values()) > 1e-3  # the gradients are not all ~0


def test_trl_metrics_on_a_hand_made_batch():
    pc, pr = jnp.array([-1.0, -3.0]), jnp.array([-2.0, -1.0])
    rc, rr = jnp.array([-1.5, -3.0]), jnp.array([-2.0, -2.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # log-ratios: chosen [0.5, 0], rejected [0, 1]; implicit rewards are beta times those.
    assert float(m["rewards/chosen"]) == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    assert float(m["rewards/rejected"]) == pytest.approx(0.5 * (0.0 + 1.0) / 2)
    assert float(m["rewards/margins"]) == pytest.approx(0.125 - 0.25)
    assert float(m["rewards/accuracies"]) == pytest.approx(0.5)  # pair 1 right (0.25 > 0), pair 2 wrong
    assert float(m["logps/chosen"]) == pytest.approx(-2.0) and float(m["logps/rejected"]) == pytest.approx(-1.5)

    def log_sigmoid(x):
        return -math.log1p(math.exp(-x))

    assert float(loss) == pytest.approx(-(log_sigmoid(0.5 * 0.5) + log_sigmoid(0.5 * -1.0)) / 2, rel=1e-6)
    # SimPO: reference-free, length-normalised: a = logp / |y|; l = -log sigmoid(beta (a_w - a_l) - gamma).
    simpo, ms = dpo_loss(pc, pr, rc * 0, rr * 0, beta=2.0, loss_type="simpo", simpo_gamma=0.5,
                         chosen_lengths=jnp.array([2.0, 3.0]), rejected_lengths=jnp.array([4.0, 1.0]))
    a_w, a_l = np.array([-0.5, -1.0]), np.array([-0.5, -1.0])
    expected = np.mean([-log_sigmoid(2.0 * (w - l_) - 0.5) for w, l_ in zip(a_w, a_l, strict=True)])
    assert float(simpo) == pytest.approx(expected, rel=1e-6)
    assert float(ms["rewards/accuracies"]) == 0.0  # equal average log-probs: no pair strictly preferred


def test_chat_pairs_use_the_chat_template_for_dpo_and_the_reward_model(tiny_chat_model):
    from jaxrl_llm.config import DataSection
    from jaxrl_llm.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_chat_model)
    records = [json.loads(line) for line in
               (ROOT / "data" / "larger_number" / "preferences_test.jsonl").read_text().splitlines()[:3]]
    cfg = DataSection(max_prompt_tokens=512)
    pairs = build_preference_set(records, "prefs", cfg, tok, eos_id=tok.eos_token_id, max_response_tokens=64)
    for i, r in enumerate(records):
        rendered = tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        assert pairs.prompt_ids[i] == tok(rendered, add_special_tokens=False)["input_ids"]
        chosen = r["chosen"][-1]["content"]
        assert pairs.chosen_ids[i] == tok(chosen, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # the reward model scores the whole conversation, the response as the assistant turn (not str(messages))
    texts = pair_texts(records, "prefs", cfg, tok)
    assert texts[0][0] == tok.apply_chat_template([*records[0]["prompt"], records[0]["chosen"][-1]], tokenize=False)
    assert "[{" not in texts[0][0] and "<|im_start|>assistant\nThe number" in texts[0][0]
    text_pairs = pair_texts([{"prompt": "1+2=", "chosen": "3", "rejected": "4"}], "t", cfg, tok)
    assert text_pairs == [("1+2=3", "1+2=4")]  # text pairs: unchanged


def _preference_files(tiny_task: Path, out: Path) -> tuple[Path, Path]:
    rows = [json.loads(line) for line in (tiny_task / "train.jsonl").read_text().splitlines()]
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": str(int(r["answer"]) + 1)} for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[:16]))  # one batch, every step
    (out / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs[200:]))
    return out / "train.jsonl", out / "test.jsonl"


def test_reference_in_the_step_equals_precomputed_and_the_run_learns(tiny_task, tmp_path):
    train, _ = _preference_files(tiny_task, tmp_path / "prefs")
    runs = {}
    for where in ("step", "precompute"):
        config = tiny_run("dpo_arithmetic", tmp_path / where, f"data.train={train}", f"data.eval={train}",
                          f"dpo.eval_prompts={tiny_task / 'test.jsonl'}", f"dpo.reference={where}", "steps=6",
                          "sft.batch_size=16", "sft.eval_batch_size=32", "optim.learning_rate=3e-3", "dpo.beta=1.0",
                          "optim.warmup_steps=0", "checkpoint_every=0",
                          # the run with the reference in the step packs its pairs (sft.packing): still the same run
                          f"sft.packing={str(where == 'step').lower()}", "sft.packing_min_gflops=0",
                          task=tiny_task)
        trainer = make_trainer(config)
        assert (trainer.algorithm.frozen is None) == (where == "precompute")  # no reference weights kept
        summary = trainer.run()
        rows = read_rows(tmp_path / where)
        runs[where] = (summary, rows, jax.tree.map(np.asarray, trainer.state["params"]))
    (s_step, rows_step, p_step), (s_pre, rows_pre, p_pre) = runs["step"], runs["precompute"]
    for a, b in zip(rows_step, rows_pre, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(p_step), jax.tree.leaves(p_pre), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    fracs = [(a["update/padding_frac"], b["update/padding_frac"]) for a, b in zip(rows_step, rows_pre, strict=True)
             if "update/padding_frac" in a]
    assert fracs and all(packed < padded for packed, padded in fracs)
    trained = [r for r in rows_step if "rewards/margins" in r]
    assert set(rows_step[-1]) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                                  "logps/chosen", "logps/rejected"}
    assert trained[-1]["rewards/margins"] > 0  # the chosen responses pull ahead of the rejected ones
    assert s_step["before"]["eval/reward_accuracy"] == 0.0  # policy == reference before any step
    assert s_step["after"]["eval/reward_accuracy"] >= 0.9  # the 16 trained pairs, evaluated after the last step
    assert s_step["after"]["eval/reward_margin"] > 0.5
    assert "eval/accuracy" in s_step["after"]  # greedy task accuracy on dpo.eval_prompts
    assert s_pre["after"] == pytest.approx(s_step["after"], abs=1e-5)


def test_chat_dpo_preset_runs_on_a_tiny_chat_model(tiny_chat_model, tmp_path):
    config = tiny_run("dpo_smollm2_larger_number", tmp_path / "run", f"model.path={tiny_chat_model}", "steps=2",
                      "sft.batch_size=2", "sft.eval_batch_size=4", "eval_size=4", "eval_batch_size=4",
                      "sampling.max_new_tokens=24", "checkpoint_every=0", "export=true")
    trainer = make_trainer(config)
    assert "<|im_start|>assistant" in trainer.algorithm.policy.tokenizer.decode(trainer.algorithm.pairs.prompt_ids[0])
    summary = trainer.run()
    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows if "rewards/accuracies" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert {"eval/reward_accuracy", "eval/logp_accuracy", "eval/accuracy"} <= set(summary["after"])
    assert (tmp_path / "run" / "hf" / "config.json").is_file()


def test_pair_batch_pads_both_sides():
    from jaxrl_llm.data import PreferenceSet

    pairs = PreferenceSet([[1, 2], [3]], [[4, 5, 9], [6, 9]], [[7, 9], [8, 8, 8, 9]], [{}, {}], 0)
    b = pair_batch(pairs, np.array([1, 0]), pad_id=0, prompt_bucket=4)
    assert isinstance(b, PairBatch)
    np.testing.assert_array_equal(b.prompt_tokens, [[0, 0, 0, 3], [0, 0, 1, 2]])
    np.testing.assert_array_equal(b.chosen_mask.sum(1), [2, 3])
    np.testing.assert_array_equal(b.rejected_tokens[0, :4], [8, 8, 8, 9])
    np.testing.assert_array_equal(b.rejected_mask.sum(1), [4, 2])
