"""The update at real scale: log-probs from hidden states in chunks equal the full-logit update, bf16 weights
train through a float32 master copy, and the planner agrees with XLA's compiled memory of the train step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.cli import plan
from jaxrl_llm.config import OptimSection
from jaxrl_llm.models.decoder import forward, init_params, param_shapes
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.weights import master_weights
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.rl.logprobs import token_logprobs_and_entropy
from jaxrl_llm.rl.policy_loss import clipped_policy_loss
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, logprob_chunk_size, policy_loss
from jaxrl_llm.trainers.step import train_step
from tests.numerics import assert_within_rounding

pytestmark = pytest.mark.heavy(seconds=14)

SMALL = dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, vocab_size=1000, tie_word_embeddings=False)


def _batch(config, rows: int = 6, prompt_len: int = 5, new: int = 11, seed: int = 0) -> PolicyBatch:
    rng = np.random.default_rng(seed)
    pt = rng.integers(1, config.vocab_size, (rows, prompt_len)).astype(np.int32)
    pm = np.ones_like(pt)
    pm[1, :2] = 0  # left padding
    ct = rng.integers(1, config.vocab_size, (rows, new)).astype(np.int32)
    cm = np.ones_like(ct)
    cm[0, 7:] = 0  # right padding
    cm[3, 4:] = 0
    old = (-7.0 + 0.3 * rng.normal(size=(rows, new))).astype(np.float32)
    ref = (-7.0 + 0.3 * rng.normal(size=(rows, new))).astype(np.float32)
    return PolicyBatch(Sequences(pt, pm, ct, cm), old, ref, rng.normal(size=rows).astype(np.float32))


def _full_logit_loss(params, batch: PolicyBatch, config, c: PolicyObjective):
    """The reference: `[N, P + T - 1, V]` logits from the plain forward, sliced, then the same loss formula."""
    s = batch.sequences
    tokens = jnp.concatenate([s.prompt_tokens, s.completion_tokens], axis=1)[:, :-1]
    mask = jnp.concatenate([s.prompt_mask, s.completion_mask], axis=1)[:, :-1]
    logits = forward(params, config, tokens, mask)[:, s.prompt_tokens.shape[1] - 1 :]
    logp, entropy = token_logprobs_and_entropy(logits, s.completion_tokens, temperature=c.temperature)
    mask_f = s.completion_mask.astype(jnp.float32)
    return clipped_policy_loss(
        logp,
        batch.old_logp,
        batch.advantages,
        s.completion_mask,
        ref_logp=batch.ref_logp,
        kl_coef=c.beta,
        entropy=entropy,
        entropy_coef=c.entropy_coef,
        num_tokens=mask_f.sum(),
        num_seqs=(mask_f.sum(axis=1) > 0).sum().astype(jnp.float32),
        options=c.options,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_update_equals_full_logit_update(tied: bool) -> None:
    config = config_from_hf({**SMALL, "tie_word_embeddings": tied})
    params = init_params(config, jax.random.key(1))
    batch = jax.tree.map(jnp.asarray, _batch(config))
    mask = batch.sequences.completion_mask.astype(jnp.float32)
    counts = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(axis=1) > 0).sum().astype(jnp.float32))
    # 6 rows x 1000 words x 4 bytes = 24,000 bytes per position: 0.07 MiB -> chunks of 3 positions (11 = 3+3+3+2).
    chunked = PolicyObjective(temperature=0.8, beta=0.04, entropy_coef=0.01, logprob_block_mib=0.07)
    assert logprob_chunk_size(6, 11, config.vocab_size, chunked.logprob_block_mib) == 3

    def ours(p):
        return policy_loss(p, batch, model_config=config, loss_config=chunked, **counts)

    def reference(p):
        return _full_logit_loss(p, batch, config, chunked)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    (ref_loss, ref_metrics), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name in ("entropy", "kl", "policy_loss"):
        np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=1e-5, atol=1e-5, err_msg=name)
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
    for (path, g), r in zip(flat, ref_flat, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    # The head's gradient is not trivially zero (the chunks' recomputed backward reaches W_out).
    head = grads["embed"]["embedding"] if tied else grads["lm_head"]["kernel"]
    assert float(jnp.abs(head).max()) > 1e-4


def test_chunk_size_rule() -> None:
    # Everything fits, or 0 = off: one block of all positions.
    assert logprob_chunk_size(8, 32, 1000, 256) == 32
    assert logprob_chunk_size(32, 512, 151_936, 0) == 512
    # The GSM8K preset's micro-batch on Qwen2.5's vocabulary: 256 MiB / (32 * 151936 * 4 B) = 13.8 positions.
    assert logprob_chunk_size(32, 512, 151_936, 256) == 13
    assert logprob_chunk_size(10_000, 512, 151_936, 1) == 1


def test_one_micro_batch_update_equals_accumulated_micro_batches() -> None:
    """`grad_accum=1` takes the gradient as it comes (no zero-filled accumulator, no scan); the same minibatch in
    2 or 3 accumulated micro-batches gives the same loss, gradient norm and AdamW step (token counts are global)."""
    config = config_from_hf({**SMALL, "vocab_size": 97})
    params = master_weights(init_params(config, jax.random.key(0)))
    optimizer = make_optimizer(OptimSection(learning_rate=1e-3, max_grad_norm=0.0), 10)[0]
    batch = jax.tree.map(jnp.asarray, _batch(config, rows=6, new=6))
    results = []
    for accum in (1, 2, 3):
        step = jax.jit(functools.partial(train_step, loss_fn=policy_loss, model_config=config,
                                         loss_config=PolicyObjective(beta=0.0), optimizer=optimizer,
                                         grad_accum=accum))
        results.append(step(params, optimizer.init(params), batch))
    for new_params, _, metrics in results[1:]:
        np.testing.assert_allclose(metrics["loss"], results[0][2]["loss"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(metrics["grad_norm"], results[0][2]["grad_norm"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(results[0][0]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(results[0][2]["grad_norm"]) > 0


def test_bf16_weights_update_through_a_float32_master() -> None:
    """At lr 1e-6 one AdamW step moves every weight by ~1e-6: below bf16's spacing (2^-8 relative), so bf16
    weights without a master copy stay exactly where they were, while the float32 master moves."""
    config = config_from_hf({**SMALL, "vocab_size": 97}, dtype="bfloat16", param_dtype="bfloat16")
    bf16_params = init_params(config, jax.random.key(0))
    assert bf16_params["layers"]["mlp"]["up"]["kernel"].dtype == jnp.bfloat16
    optimizer = make_optimizer(OptimSection(learning_rate=1e-6, max_grad_norm=0.0), 10)[0]
    batch = jax.tree.map(jnp.asarray, _batch(config, rows=4, new=6))
    step = jax.jit(functools.partial(train_step, loss_fn=policy_loss, model_config=config,
                                     loss_config=PolicyObjective(), optimizer=optimizer, grad_accum=2))

    def moved_fraction(before, after) -> float:
        a = np.asarray(before["layers"]["mlp"]["up"]["kernel"], np.float32)
        b = np.asarray(after["layers"]["mlp"]["up"]["kernel"], np.float32)
        return float((a != b).mean())

    master = master_weights(bf16_params)
    opt_state = optimizer.init(master)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating))
    new_master, _, metrics = step(master, opt_state, batch)
    assert metrics["update_skipped"] == 0 and metrics["grad_norm"] > 0
    assert jax.tree.leaves(new_master)[0].dtype == jnp.float32
    assert moved_fraction(master, new_master) > 0.99
    # Without the master copy (bf16 weights updated in place) the same update rounds away.
    new_bf16, _, _ = step(bf16_params, optimizer.init(bf16_params), batch)
    assert moved_fraction(bf16_params, new_bf16) < 0.05  # only weights within ~1e-4 of 0 move


def test_trainer_keeps_float32_master_with_bf16_params(tiny_task, tmp_path) -> None:
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import tiny_run

    config = tiny_run("grpo_arithmetic", tmp_path / "run", "model.param_dtype=bfloat16", "model.dtype=bfloat16",
                      "optim.learning_rate=1e-6", "optim.warmup_steps=0", "rl.beta=0.04", "checkpoint_every=0",
                      "rl.entropy_coef=0.01",  # a gradient even when every reward is 0 (random model)
                      "export=true", task=tiny_task)
    run = make_trainer(config)
    trainer = run.algorithm
    before = np.asarray(run.state["params"]["layers"]["mlp"]["up"]["kernel"])
    assert before.dtype == np.float32
    assert trainer.ref_params["layers"]["mlp"]["up"]["kernel"].dtype == jnp.bfloat16
    run.run()
    after = np.asarray(run.state["params"]["layers"]["mlp"]["up"]["kernel"])
    assert after.dtype == np.float32 and (after != before).mean() > 0.9
    mu = run.state["opt_state"].inner_state[1][0].mu["layers"]["mlp"]["up"]["kernel"]
    assert mu.dtype == jnp.float32
    # The export is written in the configured parameter dtype.
    import json

    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("micro_rows,prompt_len,new_tokens,query_chunk", [(8, 32, 48, 128), (4, 64, 192, 64)])
def test_planner_agrees_with_compiled_train_step(micro_rows: int, prompt_len: int, new_tokens: int,
                                                 query_chunk: int) -> None:
    """`MemoryPlan.train_step` (params + optimizer + batch + gradient buffers + activations) vs XLA's compiled
    memory of the real step (arguments + temporaries + outputs - aliased): bf16 compute over float32 master
    weights, remat, tied embeddings, a vocabulary large enough that the chunked log-probs matter, and (second
    case) query-chunked attention; within 15% (measured 1.10 and 1.13 since the tied embedding is multiplied as
    stored, 1.09 and 1.12 under the precision policy before that, 1.05 and 1.07 before the policy; 0.98 on the
    GSM8K preset's Qwen2.5-0.5B step before it, `bench/memory_step.py`)."""
    tied = dict(SMALL, hidden_size=128, intermediate_size=384, num_hidden_layers=4, tie_word_embeddings=True,
                vocab_size=16_000)
    config = config_from_hf(tied, dtype="bfloat16", remat=True, attention_query_chunk=query_chunk)
    accum = 2
    rows = micro_rows * accum
    optimizer = make_optimizer(OptimSection(), 10)[0]
    shapes = param_shapes(config)
    ints = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.int32)  # noqa: E731
    floats = lambda t: jax.ShapeDtypeStruct((rows, t), jnp.float32)  # noqa: E731
    batch = PolicyBatch(Sequences(ints(prompt_len), ints(prompt_len), ints(new_tokens), ints(new_tokens)),
                        floats(new_tokens),
                        floats(new_tokens), jax.ShapeDtypeStruct((rows,), jnp.float32))
    loss_config = PolicyObjective(beta=0.04, logprob_block_mib=4)
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config, loss_config=loss_config,
                             optimizer=optimizer, grad_accum=accum)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(shapes, jax.eval_shape(optimizer.init, shapes),
                                                          batch).compile()
    m = compiled.memory_analysis()
    measured = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    p = plan.plan_memory(config, (1, 1, 1), batch=rows, prompt_len=prompt_len, new_tokens=new_tokens,
                         grad_accum=accum, logprob_block_mib=4)
    assert 0.85 < p.train_step / measured < 1.15, (p.train_step, measured, m)


def test_query_chunked_attention_is_the_same_function() -> None:
    """Forward logits and gradients with queries in chunks of 3 (ragged tail: 11 = 3+3+3+2) equal one block."""
    config = config_from_hf({**SMALL, "vocab_size": 97}, remat=True, attention_query_chunk=0)
    chunked = config.replace(attention_query_chunk=3)
    params = init_params(config, jax.random.key(2))
    batch = jax.tree.map(jnp.asarray, _batch(config, rows=4, prompt_len=5, new=7))
    tokens, mask = batch.sequences.inputs()
    assert tokens.shape[1] == 11

    def loss(p, c):
        logits = forward(p, c, tokens, mask)
        return jnp.where(mask[..., None] > 0, jax.nn.log_softmax(logits), 0.0).sum() * 1e-3, logits

    (l0, logits0), g0 = jax.jit(jax.value_and_grad(lambda p: loss(p, config), has_aux=True))(params)
    (l1, logits1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(p, chunked), has_aux=True))(params)
    # (a left-padding query attends to no key: its output, never read, depends on how many keys its chunk spans)
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(logits1)[valid], np.asarray(logits0)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_causal_chunks_skip_the_keys_after_them() -> None:
    """The XLA path's causal self-attention in query chunks (`attention.xla_attention`, queries that are their own
    keys) takes chunk `[a, b)` over keys `[0, b)` only: the same output and gradients as one block over every key,
    for packed rows (block-diagonal causal), a sliding window and a soft cap, at every query that attends to a key
    (a padding query's output is never read); and fewer FLOPs."""
    from jaxrl_llm.models import attention as A

    rng = np.random.default_rng(5)
    b, t, h, kvh, hd = 2, 23, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.float32) for n in (h, kvh, kvh))
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 0]], [9, 6, 5, 3], axis=1), jnp.int32)
    mask, real = A.AttentionMask.packed(segments), np.asarray(segments > 0)
    for window, cap in ((None, None), (4, 30.0)):
        spec = A.AttentionSpec(window=window, softcap=cap)

        def attend(q, k, v, chunk, spec=spec):
            return A.xla_attention(q, k, v, mask, spec, query_chunk=chunk)

        def loss(q, k, v, chunk):
            return (jnp.where(real[..., None], attend(q, k, v, chunk), 0.0) ** 2).sum()

        # The two programs sum over different key ranges (the skipped keys add exact zeros), so they round apart:
        # each value is a float32 sum over at most t keys and then hd head dims, and each program's rounding is
        # at most about (t + hd) u of the largest value (u = 2^-24; observed: <= 7 u on an AVX2-only CPU).
        assert_within_rounding(np.asarray(attend(q, k, v, 5))[real], np.asarray(attend(q, k, v, 0))[real],
                               terms=t + hd)
        grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, chunk) for chunk in (5, 0)]
        for got, want in zip(*grads, strict=True):
            assert_within_rounding(got, want, terms=t + hd)
    flops = [jax.jit(lambda q, k, v, chunk=chunk: A.xla_attention(q, k, v, mask, A.AttentionSpec(), query_chunk=chunk)
                     ).lower(q, k, v).cost_analysis()["flops"] for chunk in (5, 0)]
    # chunks of 5 against one block over every key: (25 + 50 + 75 + 100 + 3 x 23) / 23^2 = 0.60 of the scores
    assert flops[0] < 0.75 * flops[1], flops
