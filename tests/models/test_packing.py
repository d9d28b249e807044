"""The padding-free update (jaxrl_llm.models.packing): the host plan (first-fit decreasing bins, each sequence's
tokens where the layout says), attention that never crosses a sequence, and the packed update equal to the padded
one: loss, metrics and gradients of every aggregation mode and surrogate, with micro-batches, on several model
families; a GRPO run and a multi-turn run with `rl.packing=true` against the same runs padded."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.models.decoder import forward, forward_packed, init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models.packing import (
    PackedLayout,
    bucket_rows,
    first_fit_decreasing,
    micro_batch_layout,
    packed_inputs,
    packing_pays,
    token_budget_micro_batches,
    update_layouts,
)
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.rl import PolicyLossOptions
from jaxrl_llm.trainers import make_trainer
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, completion_logprobs, policy_loss
from jaxrl_llm.trainers.step import minibatch_rows, train_step
from tests.attention_reference import segment_attention_allowed
from tests.families import FAMILIES, TINY
from tests.runs import ROOT, read_rows, tiny_run

pytestmark = pytest.mark.heavy(seconds=29)

PROPS = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------------------------------------ the host plan


@PROPS
@given(st.lists(st.integers(0, 20), min_size=1, max_size=24), st.integers(20, 40))
def test_first_fit_decreasing_places_every_sequence_once_within_capacity(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # first fit: no two bins could be merged (else the later one's items would have gone to the earlier)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(loads[i] + loads[j] > capacity for i in range(len(bins)) for j in range(i + 1, len(bins)))


def test_first_fit_decreasing_by_hand():
    # sorted: 7 (0), 5 (2), 4 (3), 3 (1), 1 (4) into 10: [7, 3], [5, 4, 1]
    assert first_fit_decreasing([7, 3, 5, 4, 1], 10) == [[0, 1], [2, 3, 4]]
    assert bucket_rows(3, 8) == 3 and bucket_rows(5, 64) == 8 and bucket_rows(60, 64) == 64 and bucket_rows(9, 12) == 9


def _padded_batch(rng: np.random.Generator, n: int, p: int, t: int, vocab: int) -> tuple[np.ndarray, ...]:
    """Left-padded prompts `[n, p]` (1..p tokens) and right-padded completions `[n, t]` (0..t tokens)."""
    plen = rng.integers(1, p + 1, n)
    clen = rng.integers(0, t + 1, n)
    clen[0] = t  # one full-length row: the longest sequence fills a packed row
    pm = (np.arange(p)[None] >= p - plen[:, None]).astype(np.int32)
    cm = (np.arange(t)[None] < clen[:, None]).astype(np.int32)
    pt = np.where(pm, rng.integers(1, vocab, (n, p)), 0).astype(np.int32)
    ct = np.where(cm, rng.integers(1, vocab, (n, t)), 0).astype(np.int32)
    return pt, pm, ct, cm


@PROPS
@given(st.integers(0, 10_000))
def test_the_layout_holds_each_sequence_and_points_at_its_predictors(seed):
    rng = np.random.default_rng(seed)
    p, t = 5, 6
    pt, pm, ct, cm = _padded_batch(rng, 7, p, t, 50)
    tokens = np.concatenate([pt, ct], 1)[:, :-1]
    valid = np.concatenate([pm, cm], 1)[:, :-1] > 0
    rows = len(first_fit_decreasing(valid.sum(1), valid.shape[1]))
    source, predictor = micro_batch_layout(valid, p, rows)
    layout = PackedLayout(jnp.asarray(source), jnp.asarray(predictor))
    packed, positions, segments = map(np.asarray, packed_inputs(jnp.asarray(tokens), jnp.asarray(valid, jnp.int32),
                                                                layout))
    for i in range(len(tokens)):
        at = segments.reshape(-1) == i + 1
        np.testing.assert_array_equal(packed.reshape(-1)[at], tokens[i][valid[i]])  # its tokens, in order
        np.testing.assert_array_equal(positions.reshape(-1)[at], np.arange(valid[i].sum()))  # positions restart
        for k in range(t):  # completion token k is predicted by input column p - 1 + k
            if cm[i, k]:
                assert segments.reshape(-1)[predictor[i, k]] == i + 1
                assert positions.reshape(-1)[predictor[i, k]] == pm[i].sum() - 1 + k
    assert (packed[segments == 0] == 0).all()


def test_update_layouts_follow_the_strided_micro_batches():
    """Micro-batch `a` of update `u` is rows `rows[u, a::A]`: its layout is at `[u, a::A]`, its rows' tokens in it."""
    rng = np.random.default_rng(3)
    p, t = 4, 5
    _, pm, _, cm = _padded_batch(rng, 16, p, t, 50)
    valid = np.concatenate([pm, cm], 1)[:, :-1] > 0
    rows = np.asarray(minibatch_rows(jax.random.key(0), 16, epochs=2, minibatch_size=8))
    plan = update_layouts(valid, p, rows, grad_accum=2)
    r = plan.layouts.source.shape[1] // 2
    for u in range(rows.shape[0]):
        for a in range(2):
            src = plan.layouts.source[u, a::2]
            assert src.shape[0] == r
            members = rows[u, a::2]
            got = sorted(set((src[src >= 0] // valid.shape[1]).tolist()))
            assert got == [i for i in range(4) if valid[members[i]].any()]
    real = valid[rows].sum()
    assert plan.padding_frac_padded == pytest.approx(1 - real / (rows.size * valid.shape[1]))
    row_len = plan.layouts.source.shape[-1]
    assert row_len == valid.shape[1]  # rows of the padded length by default
    assert plan.padding_frac_packed == pytest.approx(1 - real / (rows.shape[0] * 2 * r * row_len))
    assert plan.padding_frac_packed <= plan.padding_frac_padded


# ------------------------------------------------------------------------------------ attention within a sequence


def test_segment_mask_by_hand():
    allowed = np.asarray(segment_attention_allowed(jnp.asarray([[1, 1, 2, 2, 2, 0]]), None))[0]
    want = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                     [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(allowed, want)
    windowed = np.asarray(segment_attention_allowed(jnp.asarray([[1, 1, 2, 2, 2, 0]]), 2))[0]
    np.testing.assert_array_equal(windowed, want & (np.arange(6)[:, None] - np.arange(6)[None] < 2))


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "qwen3"])
def test_no_attention_crosses_a_sequence(family):
    """A packed row [A | B] gives B the hidden states B has alone; change A's tokens and B's do not move."""
    config = config_from_hf({**FAMILIES[family], "max_position_embeddings": 64})
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 97, 5), rng.integers(1, 97, 7)
    alone = forward(params, config, jnp.asarray(b[None]), jnp.ones((1, 7), jnp.int32), return_hidden=True)[0]
    for other in (a, rng.integers(1, 97, 5)):
        row = jnp.asarray(np.concatenate([other, b, [0, 0]])[None])
        positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(7), [0, 0]])[None])
        segments = jnp.asarray(np.array([1] * 5 + [2] * 7 + [0, 0])[None])
        hidden = forward_packed(params, config, row, positions, segments)[0]
        np.testing.assert_allclose(hidden[5:12], alone, rtol=2e-5, atol=2e-5)


# -------------------------------------------------------------------------------- the packed update is the padded


def _batch_and_layout(seed: int, n: int = 8, p: int = 6, t: int = 7, vocab: int = 97, grad_accum: int = 1):
    rng = np.random.default_rng(seed)
    pt, pm, ct, cm = _padded_batch(rng, n, p, t, vocab)
    old = (rng.normal(-2.0, 0.3, (n, t)) * cm).astype(np.float32)
    ref = (rng.normal(-2.0, 0.3, (n, t)) * cm).astype(np.float32)
    sampler = (old + rng.normal(0, 0.05, (n, t)) * cm).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    batch = PolicyBatch(Sequences(*map(jnp.asarray, (pt, pm, ct, cm))), *map(jnp.asarray, (old, ref, adv, sampler)))
    valid = np.concatenate([pm, cm], 1)[:, :-1] > 0
    plan = update_layouts(valid, p, np.arange(n)[None], grad_accum)
    return batch, PackedLayout(*(jnp.asarray(x[0]) for x in plan.layouts))


OBJECTIVES = {
    "token-mean": {},
    "seq-mean-token-mean": {"aggregation": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"aggregation": "seq-mean-token-sum"},
    "dr-grpo": {"aggregation": "seq-mean-token-sum-norm"},
    "gspo": {"surrogate": "gspo", "aggregation": "seq-mean-token-mean"},
    "kl-k3-entropy": {"kl_estimator": "k3", "beta": 0.1, "entropy_coef": 0.01},
    "sequence-is-mask": {"rollout_correction": "sequence_mask"},
}


def _objective(settings: dict) -> PolicyObjective:
    s = dict(settings)
    top = {k: s.pop(k) for k in ("surrogate", "beta", "entropy_coef") if k in s}
    return PolicyObjective(options=PolicyLossOptions(**s), max_len=7, **top)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_packed_policy_loss_equals_padded(name):
    """Loss, every metric and every gradient of `policy_loss` over the packed layout equal the padded layout's
    (float32, 1e-5 relative)."""
    config = config_from_hf({**TINY, "vocab_size": 97, "tie_word_embeddings": False})
    params = init_params(config, jax.random.key(1))
    batch, layout = _batch_and_layout(0)
    objective = _objective(OBJECTIVES[name])
    counts = dict(num_tokens=jnp.float32(batch.sequences.completion_mask.sum()),
                  num_seqs=jnp.float32((batch.sequences.completion_mask.sum(1) > 0).sum()))

    @jax.jit
    def value_and_grad(params, batch):
        return jax.value_and_grad(lambda w: policy_loss(w, batch, model_config=config, loss_config=objective,
                                                        **counts), has_aux=True)(params)

    if objective.options.rollout_correction == "none":
        batch = batch._replace(sampler_logp=None)
    (loss, metrics), grads = value_and_grad(params, batch)
    (loss_p, metrics_p), grads_p = value_and_grad(params, batch._replace(layout=layout))
    assert layout.source.shape[0] < batch.sequences.prompt_tokens.shape[0]  # fewer rows: the padding is gone
    np.testing.assert_allclose(loss_p, loss, rtol=1e-5, atol=1e-7)
    assert metrics_p.keys() == metrics.keys()
    for key in metrics:
        np.testing.assert_allclose(metrics_p[key], metrics[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for (path, g), gp in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_p), strict=True):
        np.testing.assert_allclose(gp, g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()), err_msg=str(path))


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "phi3"])
def test_packed_logprobs_equal_padded_across_families(family):
    config = config_from_hf({**FAMILIES[family], "max_position_embeddings": 64})
    params = init_params(config, jax.random.key(2))
    batch, layout = _batch_and_layout(1, n=6)
    args = (params, config, batch.sequences)
    fn = jax.jit(functools.partial(completion_logprobs, with_entropy=True), static_argnums=1)
    logp, entropy, _ = fn(*args)
    logp_p, entropy_p, _ = fn(*args, layout=layout)
    m = np.asarray(batch.sequences.completion_mask, bool)
    np.testing.assert_allclose(np.asarray(logp_p)[m], np.asarray(logp)[m], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(entropy_p)[m], np.asarray(entropy)[m], rtol=1e-5, atol=1e-5)


def test_packed_micro_batches_give_the_one_batch_update():
    """`train_step` with 2 packed micro-batches equals one padded batch: loss, gradient norm, updated weights."""
    config = config_from_hf({**TINY, "vocab_size": 97})
    params = init_params(config, jax.random.key(3))
    optimizer = optax.apply_if_finite(optax.sgd(1.0), 1)  # moves by the gradient itself (Adam: by its sign)
    batch, _ = _batch_and_layout(4, n=8)
    batch = batch._replace(sampler_logp=None)
    valid = np.concatenate([batch.sequences.prompt_mask, batch.sequences.completion_mask], 1)[:, :-1] > 0
    plan = update_layouts(valid, batch.sequences.prompt_tokens.shape[1], np.arange(8)[None], grad_accum=2)
    packed = batch._replace(layout=PackedLayout(*(jnp.asarray(x[0]) for x in plan.layouts)))
    objective = PolicyObjective(options=PolicyLossOptions(aggregation="seq-mean-token-mean"), beta=0.05)

    def step(b, accum):
        return jax.jit(functools.partial(train_step, loss_fn=policy_loss, model_config=config, loss_config=objective,
                                         optimizer=optimizer, grad_accum=accum))(params, optimizer.init(params), b)

    one, _, m_one = step(batch, 1)
    two, _, m_two = step(packed, 2)
    np.testing.assert_allclose(m_two["loss"], m_one["loss"], rtol=1e-5)
    np.testing.assert_allclose(m_two["grad_norm"], m_one["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ whole runs


def _run(tmp_path: Path, name: str, task: Path, *overrides: str) -> list[dict]:
    config = tiny_run("grpo_arithmetic", tmp_path / name, "steps=2", "rl.prompts_per_step=8", "rl.mu=2",
                      "rl.minibatch_size=16", "rl.grad_accum=2", "sampling.max_new_tokens=16",
                      "sampling.prompt_bucket=32", "eval_every=0",
                      "rewards=[{name: 'tests.runs:completion_length'}]",
                      *overrides, task=task)
    make_trainer(config).run()
    return read_rows(tmp_path / name, having="loss")


def test_a_grpo_run_packed_trains_as_padded(tiny_task, tmp_path):
    """Two GRPO steps (2 epochs x 2 minibatches x 2 micro-batches of 8 each, a reward on the completion's length,
    prompts padded to 32 tokens) with rl.packing=true log the padded run's losses, gradient norms and KL, and a
    smaller share of padding computed."""
    padded = _run(tmp_path, "padded", tiny_task, "rl.beta=0.05")
    packed = _run(tmp_path, "packed", tiny_task, "rl.beta=0.05", "rl.packing=true", "rl.packing_min_gflops=0")
    for a, b in zip(padded, packed, strict=True):
        for key in ("loss", "grad_norm", "kl", "entropy", "reward/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert 0.0 <= b["update/padding_frac"] < a["update/padding_frac"]


def test_a_multi_turn_update_packed_is_the_padded_update(tiny_task, tmp_path):
    """One rollout of multi-turn episodes (the model's turns and the environment's replies in one sequence, a loss
    mask on the model's tokens, per-turn credit) updated packed and padded: the same metrics and weights."""
    from jaxrl_llm.data import DataState

    def trainer(packing: bool):
        return make_trainer(tiny_run("grpo_arithmetic", tmp_path / f"run{packing}", "data.eval=",
                                     "env.name=tests.trainers.test_multi_turn:rewarding", "env.max_tokens=64",
                                     "rl.beta=0.04",
                                     "optim.warmup_steps=0", "rl.minibatch_size=8", "rl.grad_accum=2",
                                     f"rl.packing={str(packing).lower()}", "rl.packing_min_gflops=0",
                                     task=tiny_task))

    padded, packed = trainer(False), trainer(True)
    ro = padded.algorithm.collect(padded.state, DataState(), jax.random.key(0)).batch
    assert ro.loss_mask is not None and ro.turn_credit is not None and max(ro.episode_stats["turns"]) > 1
    a = padded.algorithm.update(padded.state, ro, 1, jax.random.key(1))
    b = packed.algorithm.update(packed.state, ro, 1, jax.random.key(1))
    for key in ("loss", "policy_loss", "grad_norm", "kl", "entropy"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-5, abs=1e-7), key
    assert b.metrics["update/padding_frac"] < a.metrics["update/padding_frac"]
    # bf16 dots contract over the layouts' different position counts, so float32 sums associate differently, and
    # Adam's first step (lr * g / |g|, lr 1e-4) turns that rounding on a near-zero gradient into up to ~1e-6:
    # a tenth of one step still catches any gradient that differs.
    for x, y in zip(jax.tree.leaves(a.state["params"]), jax.tree.leaves(b.state["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)


def test_ppo_packed_trains_as_padded(tiny_task, tmp_path):
    """PPO's policy and critic (the same packed rows, token-budget micro-batches) over two steps: the padded run's
    losses and gradients."""

    def run(name: str, *extra: str) -> list[dict]:
        make_trainer(tiny_run("ppo_arithmetic", tmp_path / name, "steps=2", "rl.prompts_per_step=8", "rl.group_size=1",
                              "rl.minibatch_size=4", "ppo.critic_warmup_steps=0", "sampling.prompt_bucket=32",
                              "eval_every=0", *extra, task=tiny_task)).run()
        return read_rows(tmp_path / name, having="loss")

    # packed, and split by tokens into several micro-batches (the padded run has one per minibatch)
    padded, packed = run("padded"), run("packed", "rl.packing=true", "rl.max_tokens_per_microbatch=40")
    for a, b in zip(padded, packed, strict=True):
        assert b["update/micro_batches"] > 1 == a["update/micro_batches"]
        for key in ("loss", "grad_norm", "value_loss", "critic/grad_norm", "values/mean", "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert b["update/padding_frac"] < a["update/padding_frac"]


def test_sft_of_lora_adapters_packed_trains_as_padded(tiny_task, tmp_path):
    """SFT of LoRA adapters (unmerged factors in the packed forward) with sft.packing=true: the padded run's losses
    and gradient norms (float32: in bfloat16 the two layouts' dot operands round apart, ~6e-5 relative)."""
    extra = ("lora.rank=4", "lora.alpha=8", "model.dtype=float32")

    def run(name: str, *more: str) -> list[dict]:
        make_trainer(tiny_run("grpo_arithmetic", tmp_path / name, "algo=sft", "steps=2", "sft.batch_size=8",
                              "data.eval=", "sampling.prompt_bucket=32", "optim.warmup_steps=0", *extra, *more,
                              task=tiny_task)).run()
        return read_rows(tmp_path / name, having="loss")

    padded, packed = run("padded"), run("packed", "sft.packing=true", "sft.packing_min_gflops=0")
    for a, b in zip(padded, packed, strict=True):
        for key in ("loss", "sft_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert b["update/padding_frac"] < a["update/padding_frac"]


def test_a_reward_model_packed_trains_as_padded(tmp_path):
    """`--algo rm` with sft.packing=true (both sides of each pair in one packed forward pass, the score read at each
    sequence's last token): the padded run's losses, accuracies and gradient norms."""
    import json

    from jaxrl_llm.config import load_run_config
    from jaxrl_llm.tasks.arithmetic import make_preferences, make_problems

    base = ROOT / "models" / "arith-base"
    pairs = make_preferences(make_problems(40, seed=1, max_digits=2), seed=2)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))

    def run(name: str, *extra: str) -> list[dict]:
        make_trainer(load_run_config(None, [f"model.path={base}", f"data.train={tmp_path / 'train.jsonl'}",
                                            "data.eval=", f"out_dir={tmp_path / name}", "steps=2", "sft.batch_size=8",
                                            "progress_bar=false", "tensorboard=false", "export=false",
                                            "report=false", *extra], algo="rm")).run()
        return read_rows(tmp_path / name, having="loss")

    padded, packed = run("padded"), run("packed", "sft.packing=true", "sft.packing_min_gflops=0")
    assert len(padded) == 2
    for a, b in zip(padded, packed, strict=True):
        for key in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
        assert b["update/padding_frac"] < a["update/padding_frac"]


def test_token_budget_micro_batches_deal_sequences_by_length():
    lengths = np.array([10, 1, 9, 2, 8, 3, 7, 4])
    rows, accum = token_budget_micro_batches(lengths, np.arange(8)[None], budget=12)
    assert accum == 4  # 44 tokens: 3 micro-batches would be 15 each; 4 (a divisor of 8) are 11
    groups = [sorted(lengths[rows[0, a::4]].tolist()) for a in range(4)]
    # longest first, snake order: [10, 1], [9, 2], [8, 3], [7, 4]
    assert groups == [[1, 10], [2, 9], [3, 8], [4, 7]]
    assert sorted(rows[0].tolist()) == list(range(8))  # the same minibatch, reordered
    assert token_budget_micro_batches(lengths, np.arange(8)[None], budget=100)[1] == 1
    assert token_budget_micro_batches(lengths, np.arange(8)[None], budget=1, multiple=2)[1] == 4  # the most


def test_a_token_budget_run_trains_as_one_micro_batch(tiny_task, tmp_path):
    """rl.max_tokens_per_microbatch splits each minibatch into token-balanced micro-batches: the run logs how many,
    and the losses and gradient norms of the same run with every minibatch in one padded micro-batch."""
    whole = _run(tmp_path, "whole", tiny_task, "rl.grad_accum=1", "rl.beta=0.05")
    split = _run(tmp_path, "split", tiny_task, "rl.grad_accum=1", "rl.beta=0.05", "rl.packing=true",
                 "rl.max_tokens_per_microbatch=100")
    for a, b in zip(whole, split, strict=True):
        assert b["update/micro_batches"] > 1 and a["update/micro_batches"] == 1
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_packing_is_on_where_it_pays():
    """The default (`rl.packing=true`): a micro-batch is packed only when its padded forward's work reaches
    `rl.packing_min_gflops` (2 x parameters x positions), so the default task's 0.59M model stays padded and a
    135M model's GSM8K micro-batch packs."""
    assert not packing_pays(128 * 21, 590_000, 50.0)  # the default job: 3.2 GFLOP
    assert packing_pays(16 * 383, 135_000_000, 50.0)  # SmolLM2 on GSM8K: 1,654 GFLOP
    assert packing_pays(1, 1, 0.0)  # 0: whenever rows are saved
    assert packing_pays(10, 10**9, 20.0) and not packing_pays(10, 10**9, 20.001)  # 2 * 1e9 * 10 = 20 GFLOP


def test_the_default_run_of_a_tiny_model_updates_padded(tiny_task, tmp_path):
    """rl.packing defaults to true; on a tiny model the update stays padded (its padding share is the padded
    layout's), and with the threshold at 0 it packs and computes less padding."""
    default = _run(tmp_path, "default", tiny_task, "steps=1")
    forced = _run(tmp_path, "forced", tiny_task, "steps=1", "rl.packing_min_gflops=0")
    assert forced[0]["update/padding_frac"] < default[0]["update/padding_frac"]
    assert forced[0]["loss"] == pytest.approx(default[0]["loss"], rel=1e-4, abs=1e-6)


def test_the_reference_and_old_policy_passes_run_packed(tiny_task, tmp_path):
    """With rl.packing the whole-rollout log-prob passes (the reference model's, the old policy's) run on packed rows
    (fewer than the rollout's) and return the padded pass's log-probs (float32, <= 1e-5); too small a pass to gain
    (rl.packing_min_gflops) or rl.packing=false stays padded."""
    from jaxrl_llm.data import DataState
    from jaxrl_llm.trainers.rl import logprob_pass_layout

    trainer = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "run", "rl.beta=0.04", "rl.packing=true",
                                    "rl.packing_min_gflops=0", "sampling.max_new_tokens=24",
                                    "sampling.prompt_bucket=32", task=tiny_task))
    algorithm = trainer.algorithm
    ro = algorithm.collect(trainer.state, DataState(), jax.random.key(0)).batch
    num_params = algorithm.policy.model_config.num_params()
    layout = logprob_pass_layout(algorithm.config, ro, algorithm.mesh, num_params)
    assert layout is not None and layout.source.shape[0] < len(ro.prompt_tokens)
    sequences = jax.tree.map(jnp.asarray, ro.sequences())
    padded = np.asarray(algorithm.ref_logprob_fn(algorithm.ref_params, sequences))
    packed = np.asarray(algorithm.ref_logprob_fn(algorithm.ref_params, sequences, layout))
    mask = ro.out.mask.astype(bool)
    assert mask.sum() > 100 and (~mask).sum() > 0  # completions of several lengths
    np.testing.assert_allclose(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)
    algorithm.config.rl.packing_min_gflops = 1e6
    assert logprob_pass_layout(algorithm.config, ro, algorithm.mesh, num_params) is None
    algorithm.config.rl.packing_min_gflops, algorithm.config.rl.packing = 0, False
    assert logprob_pass_layout(algorithm.config, ro, algorithm.mesh, num_params) is None
