"""LoRA (`lora.rank > 0`): B = 0 starts exactly at the base, only adapters change and own optimizer state, the
merged export equals PEFT's adapter forward (transformers + peft, unmerged x W + B A x), checkpoint / resume, and
SFT / DPO / PPO runs with adapters; the mesh test is in test_sharding.py."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_llm.models.decoder import forward
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.models.lora import LoraSpec, init_adapters, merge_adapters, target_paths
from jaxrl_llm.trainers import make_trainer
from tests.runs import assert_config_refused, read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=31)


def length_reward(prompts, completions, **fields):
    """A reward a random model's samples differ in (every group has a learning signal)."""
    return [float(len(c)) for c in completions]


def _config(tiny_task: Path, out: Path, *extra: str, preset: str = "grpo_arithmetic"):
    return tiny_run(preset, out, "data.eval=", "lora.rank=4", "lora.alpha=8", "optim.learning_rate=1e-2",
                    "optim.warmup_steps=0", "rewards=[{name: 'tests.models.test_lora:length_reward'}]", *extra,
                    task=tiny_task)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_zero_b_is_the_base_model_exactly(tiny_task):
    config, params = load_hf_model(tiny_task / "model")
    spec = LoraSpec(rank=4, alpha=8.0, targets="(q|v)_proj")
    adapters = init_adapters(params, spec, jax.random.key(0))
    assert sorted(p[2] for p in target_paths(params, spec.targets)) == ["q", "v"]
    merged = merge_adapters(params, adapters, spec.scale)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(params), _leaves(merged), strict=True))
    tokens = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], np.int32)
    mask = (tokens > 0).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(forward(merged, config, tokens, mask)),
                                  np.asarray(forward(params, config, tokens, mask)))
    with pytest.raises(Exception, match="matches no layer kernel.*self_attn.q_proj"):
        target_paths(params, "nothing_like_this")


def test_only_adapters_train_and_own_the_optimizer_state_and_resume_is_exact(tiny_task, tmp_path):
    trainer = make_trainer(_config(tiny_task, tmp_path / "run", "steps=2", "checkpoint_every=1"))
    algo = trainer.algorithm
    base_before = _leaves(algo.policy.base)
    adapters_before = _leaves(trainer.state["params"])
    trainer.run()
    assert all(np.array_equal(a, b) for a, b in zip(base_before, _leaves(algo.policy.base), strict=True))
    after = _leaves(trainer.state["params"])
    assert any(not np.array_equal(a, b) for a, b in zip(adapters_before, after, strict=True))
    adapter_size = sum(x.size for x in after)
    moments = [x for x in jax.tree.leaves(trainer.state["opt_state"]) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * adapter_size  # AdamW's mu and nu, adapter-sized, nothing else
    kernels = [np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(algo.policy.base)[0]
               if "layers" in jax.tree_util.keystr(p) and "kernel" in jax.tree_util.keystr(p)]
    assert adapter_size == sum(layers * 4 * (fan_in + fan_out) for layers, fan_in, fan_out in kernels)  # L r (in+out)
    # the reference of the KL term / DPO is the base itself: no second copy
    trainer_kl = make_trainer(_config(tiny_task, tmp_path / "kl", "steps=1", "rl.beta=0.1"))
    assert trainer_kl.algorithm.ref_params is trainer_kl.algorithm.policy.base

    resumed = make_trainer(_config(tiny_task, tmp_path / "run", "steps=3", "checkpoint_every=1"),
                           resume=True)
    assert resumed.step == 2
    resumed.run()
    straight = make_trainer(_config(tiny_task, tmp_path / "straight", "steps=3", "checkpoint_every=0"))
    straight.run()
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(resumed.state["params"]),
                                                    _leaves(straight.state["params"]), strict=True))


def test_merged_export_equals_peft_adapter_forward(tiny_task, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    # float32: PEFT's float32 forward is the reference at 1e-5 (the default preset computes in bf16).
    trainer = make_trainer(_config(tiny_task, out, "steps=2", "checkpoint_every=0", "export=true",
                                   "lora.export_adapters=true", "model.dtype=float32"))
    summary = trainer.run()
    assert summary["export"] == str(out / "hf")
    assert (out / "hf" / "adapter" / "adapter_config.json").is_file()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 9, 8, 7, 6, 5]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()(ids).logits.numpy()
        base = AutoModelForCausalLM.from_pretrained(tiny_task / "model").eval()
        adapted = peft.PeftModel.from_pretrained(base, out / "hf" / "adapter").eval()
        with_adapters = adapted(ids).logits.numpy()  # PEFT's forward: x W + scale * B(A(x)), unmerged
    np.testing.assert_allclose(merged, with_adapters, atol=1e-5)
    policy = trainer.algorithm.policy
    ours = np.asarray(forward(policy.model_weights(trainer.state["params"]), policy.model_config,
                              ids.numpy().astype(np.int32), np.ones(ids.shape, np.int32)))
    np.testing.assert_allclose(ours, with_adapters, atol=1e-5)
    config = json.loads((out / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}


def test_sft_dpo_and_ppo_train_with_adapters(tiny_task, tmp_path):
    rows = [json.loads(line) for line in (tiny_task / "train.jsonl").read_text().splitlines()][:32]
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["answer"],
                                         "rejected": str(int(r["answer"]) + 1)}) + "\n" for r in rows))
    common = ["steps=1", "checkpoint_every=0", "sft.batch_size=8",
              "lora.dropout=0.05"]  # the unmerged update with a dropout key, in each trainer
    runs = {
        "sft": _config(tiny_task, tmp_path / "sft", *common, "algo=sft"),  # SFT of model.path (no model.init)
        "dpo": _config(tiny_task, tmp_path / "dpo", *common, f"data.train={prefs}", "dpo.eval_prompts=",
                       preset="dpo_arithmetic"),
        "ppo": _config(tiny_task, tmp_path / "ppo", *common, "rl.minibatch_size=8", preset="ppo_arithmetic"),
    }
    for name, config in runs.items():
        trainer = make_trainer(config)
        policy = trainer.algorithm.policy
        assert policy.lora is not None and policy.lora_dropout, name
        base = _leaves(policy.base)
        if name == "dpo":
            assert trainer.algorithm.frozen["reference"] is policy.base  # adapters off = the reference
        trainer.run()
        assert all(np.array_equal(a, b) for a, b in zip(base, _leaves(policy.base), strict=True)), name
        paths = jax.tree_util.tree_flatten_with_path(trainer.state["params"])[0]
        lora_b = [np.abs(np.asarray(x)).max() for p, x in paths if "lora_b" in jax.tree_util.keystr(p)]
        assert max(lora_b) > 0, name  # B moved away from 0: the adapters learned


def test_lora_options_are_checked():

    assert_config_refused(["lora.rank=8", "lora.dropout=1.0"], "lora.dropout=1.0 must be >= 0 and < 1")
    assert_config_refused(["lora.rank=8", "algo=rm"], "algo=rm")
    assert_config_refused(["lora.rank=8", "lora.targets=(q"], "not a regular expression")


def test_bf16_base_with_float32_adapters(tiny_task, tmp_path):
    import jax.numpy as jnp

    trainer = make_trainer(_config(tiny_task, tmp_path / "bf16", "steps=2", "checkpoint_every=0",
                                   "model.dtype=bfloat16", "model.param_dtype=bfloat16"))
    policy = trainer.algorithm.policy
    assert {x.dtype for x in jax.tree.leaves(policy.base)} == {jnp.dtype(jnp.bfloat16)}  # half the base bytes
    assert {x.dtype for x in jax.tree.leaves(trainer.state["params"])} == {jnp.dtype(jnp.float32)}  # float32 adapters
    trainer.run()
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in read_rows(tmp_path / "bf16"))


def test_unmerged_adapters_with_dropout(tiny_task, tmp_path):
    """The unmerged forward (`insert_adapters`, what the update runs with lora.dropout > 0) equals the merged one
    without a dropout key; with a key it drops (the same key, the same mask), at the PEFT scale; and a GRPO run with
    lora.dropout trains the adapters and samples from the merged model."""
    import dataclasses

    import jax.numpy as jnp

    from jaxrl_llm.models.lora import insert_adapters

    config, params = load_hf_model(tiny_task / "model")
    spec = LoraSpec(rank=4, alpha=8.0, targets="(q|k|v|o|gate|up|down)_proj")
    adapters = init_adapters(params, spec, jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), adapters)  # B != 0
    unmerged_config = dataclasses.replace(config, lora_scale=spec.scale, lora_dropout=0.5)
    tokens = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], np.int32)
    mask = (tokens > 0).astype(np.int32)
    merged = forward(merge_adapters(params, adapters, spec.scale), config, tokens, mask)
    unmerged = forward(insert_adapters(params, adapters), unmerged_config, tokens, mask)
    np.testing.assert_allclose(np.asarray(unmerged), np.asarray(merged), atol=1e-5)
    key = jax.random.key(7)
    dropped = forward(insert_adapters(params, adapters), unmerged_config, tokens, mask, dropout_key=key)
    again = forward(insert_adapters(params, adapters), unmerged_config, tokens, mask, dropout_key=key)
    other = forward(insert_adapters(params, adapters), unmerged_config, tokens, mask,
                    dropout_key=jax.random.key(8))
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))
    assert float(jnp.abs(dropped - merged).max()) > 1e-3 and float(jnp.abs(dropped - other).max()) > 1e-3
    base_only = forward(params, config, tokens, mask)  # without adapters nothing drops: the base is untouched
    np.testing.assert_array_equal(np.asarray(forward(params, unmerged_config, tokens, mask, dropout_key=key)),
                                  np.asarray(base_only))

    trainer = make_trainer(_config(tiny_task, tmp_path / "drop", "steps=2", "checkpoint_every=0",
                                   "lora.dropout=0.1"))
    assert trainer.algorithm.policy.lora_dropout
    before = _leaves(trainer.state["params"])
    trainer.run()
    assert any(not np.array_equal(a, b) for a, b in zip(before, _leaves(trainer.state["params"]),
                                                        strict=True))
