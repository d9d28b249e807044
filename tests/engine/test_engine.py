"""The rollout engine (jaxrl_llm/engine): greedy parity with transformers, log-probs against a fresh forward pass,
prompt pages shared across a group, a conversation's next turn prefilling only its new tokens, the same tokens
under any scheduling, no page leaked, queueing when the pool is small."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.engine import Request, engine_sample
from jaxrl_llm.engine.allocator import OutOfPages, PageAllocator
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.hf import load_hf_model
from jaxrl_llm.sampling import SamplingConfig, sample
from tests.batches import small_engine
from tests.families import hf_generate, left_padded_batch, make_hf_model, one_per_model_type
from tests.numerics import fresh_logits, gather_logprobs
from tests.runs import ROOT

pytestmark = pytest.mark.heavy(seconds=15)

LENGTHS = [5, 12, 1, 9]


@pytest.mark.parametrize("kind", one_per_model_type())
def test_greedy_matches_transformers_generate(kind, hf_model_dir):
    """Prompts of lengths 1..12 in one call give transformers' greedy tokens, for every model type (Gemma 2: soft
    caps, a sliding window on alternate layers; Phi-3: a window on every layer, shorter than the context; the MoE
    layouts' routers)."""
    config, params = load_hf_model(hf_model_dir(kind))
    if config.is_hybrid:  # linear-attention layers: refused in one line (make_sampler hands them to the static one)
        with pytest.raises(ConfigError, match="no linear-attention state"):
            small_engine(config)
        return
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=11)
    expected = hf_generate(make_hf_model(kind), tokens, mask, 24)
    engine = small_engine(config)
    out = engine_sample(engine, params, config, tokens, mask, jax.random.key(0),
                        SamplingConfig(max_new_tokens=24, greedy=True))
    np.testing.assert_array_equal(out.tokens, expected)
    assert out.lengths.tolist() == [24] * 4 and not out.stopped_on_eos.any()
    assert engine.allocator.in_use() == 0 and engine.allocator.reserved == 0  # every page back


def test_logprobs_equal_fresh_forward_pass_and_eos_stops(hf_model_dir):
    """Sampled tokens' log-probs (T = 0.7, top-k, EOS on) equal log_softmax(logits / T) of a fresh forward pass over
    prompt + completion (<= 1e-4), so the trainer can use them as the old policy's; rows stop at an EOS id."""
    config, params = load_hf_model(hf_model_dir("qwen3"))
    tokens, mask = left_padded_batch(config.vocab_size, [4, 9, 6], seed=3)
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.7, n=2, eos_ids=(5, 7))
    out = engine_sample(small_engine(config), params, config, tokens, mask, jax.random.key(1), sampling)
    valid = out.mask.astype(bool)
    assert valid.sum() > 40 and (~valid).sum() > 0  # some rows stopped early on an EOS id
    for r in range(out.tokens.shape[0]):
        n = int(out.lengths[r])
        assert bool(out.stopped_on_eos[r]) == (int(out.tokens[r, n - 1]) in (5, 7)) and valid[r, :n].all()
    scaled = fresh_logits(params, config, tokens, mask, out, n=2) / 0.7
    expected = gather_logprobs(np.asarray(jax.nn.log_softmax(scaled)), out.tokens)
    assert np.abs(out.logprobs_untruncated - expected)[valid].max() <= 1e-4
    assert np.abs(out.logprobs - expected)[valid].max() <= 1e-4  # no truncation: the two are one distribution


def test_prefill_chunks_are_as_wide_as_their_tokens(hf_model_dir, monkeypatch):
    """Prefill calls compute whole 16-token columns, not powers of two: prompts of 43 tokens run one 48-wide chunk; a
    140-token prompt with chunks of 128 runs 128 columns, then 16 for its last 12 tokens; the tokens are those of
    one chunk as wide as the prompt."""
    import jaxrl_llm.engine.runner as runner

    config, params = load_hf_model(hf_model_dir("llama"))
    widths: list[int] = []
    run = runner.prefill_program

    def recorded(params, weights, pages, tokens, *args, **kwargs):
        widths.append(int(tokens.shape[1]))
        return run(params, weights, pages, tokens, *args, **kwargs)

    monkeypatch.setattr(runner, "prefill_program", recorded)
    sampling = SamplingConfig(max_new_tokens=3, greedy=True)
    rows = [[1 + (7 * i + j) % (config.vocab_size - 1) for j in range(n)] for i, n in enumerate((43, 40))]
    engine = small_engine(config, num_pages=256, prefill_chunk=128, prefill_rows=4)
    out = engine.generate(params, [Request(r, jax.random.key(0)) for r in rows], sampling)
    assert widths == [48]
    long = [1 + (3 * j) % (config.vocab_size - 1) for j in range(140)]
    widths.clear()
    chunked = engine.generate(params, [Request(long, jax.random.key(0))], sampling)
    assert widths == [128, 16] and engine.stats.prefilled_tokens == 140
    whole = small_engine(config, num_pages=256, prefill_chunk=256, prefill_rows=4)
    assert chunked[0][0].tokens == whole.generate(params, [Request(long, jax.random.key(0))], sampling)[0][0].tokens
    assert len(out) == 2 and engine.allocator.in_use() == 0


def test_a_group_shares_its_prompt_pages(hf_model_dir):
    """n samples of a prompt: the prompt is prefilled once, its full pages are read by all n (one copy of each), and
    the pool's peak is below what n separate copies would take."""
    config, params = load_hf_model(hf_model_dir("llama"))
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages of 4 and a partial one
    engine = small_engine(config, slots=8)
    engine.generate(params, [Request(prompt, jax.random.key(0), n=8)], SamplingConfig(max_new_tokens=6))
    assert engine.stats.prefilled_tokens == 18
    assert engine.stats.shared_pages == 4 * 7  # 4 full pages, 7 samples beside the first
    own = -(-(18 + 6 - 1) // 4) - 4  # each sample's pages past the shared ones: its partial copy and growth
    assert engine.stats.peak_pages <= 4 + 1 + 8 * own < 8 * -(-(18 + 6 - 1) // 4)
    assert engine.allocator.in_use() == 0


def test_a_conversation_continues_from_its_pages(hf_model_dir):
    """A kept conversation's next turn prefills only the new tokens (and the last sampled one), and gives the
    tokens a fresh call on the whole context gives; releasing it frees its pages."""
    config, params = load_hf_model(hf_model_dir("mistral"))
    greedy = SamplingConfig(max_new_tokens=7, greedy=True)
    engine = small_engine(config)
    first = engine.generate(params, [Request([3, 14, 15, 9, 2], jax.random.key(0))], greedy, keep=True)[0][0]
    conversation = first.conversation
    assert conversation.tokens == [3, 14, 15, 9, 2] + first.tokens and conversation.written == 11
    assert engine.allocator.in_use() == len(conversation.pages) == 3
    reply = [26, 5, 35]
    second = engine.generate(params, [Request(reply, jax.random.key(1), conversation=conversation)], greedy,
                             keep=True)[0][0]
    assert engine.stats.prefilled_tokens == 1 + len(reply)  # the turn's last token, then the reply: no re-prefill
    fresh = small_engine(config).generate(params, [Request(conversation.tokens + reply, jax.random.key(2))],
                                          greedy)[0][0]
    assert second.tokens == fresh.tokens
    engine.release(second.conversation)
    assert engine.allocator.in_use() == 0 and engine.allocator.reserved == 0


def test_same_seed_same_tokens_under_any_scheduling(hf_model_dir):
    """A row's tokens depend on its key and position only: two slot counts, page sizes, steps per call and pool
    sizes (one small enough that requests queue for pages) give the same samples; another key gives others."""
    config, params = load_hf_model(hf_model_dir("gemma3"))
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=5)
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, n=3, eos_ids=(4,))

    def run(key: int, **settings):
        engine = small_engine(config, **settings)
        out = engine_sample(engine, params, config, tokens, mask, jax.random.key(key), sampling)
        assert engine.allocator.in_use() == 0 and engine.allocator.reserved == 0
        return out.tokens

    reference = run(0)
    np.testing.assert_array_equal(run(0, slots=12, steps_per_call=16, page_size=8, prefill_rows=4), reference)
    np.testing.assert_array_equal(run(0, num_pages=16, slots=2, steps_per_call=3), reference)  # queued for pages
    assert (run(1) != reference).any()


def test_a_decode_call_computes_the_occupied_rows_rounded_to_few_counts():
    """`decode_rows`: the next power of two (at least an eighth of the slots); above half the slots, the next
    quarter where a quarter is at least 16 rows (hand-counted)."""
    from jaxrl_llm.engine.scheduler import decode_rows

    assert [decode_rows(n, 128) for n in (1, 16, 17, 33, 64, 65, 96, 97, 128)] == [16, 16, 32, 64, 64, 96, 96, 128,
                                                                                    128]
    assert [decode_rows(n, 64) for n in (33, 48, 49)] == [48, 48, 64]
    assert [decode_rows(n, 32) for n in (1, 5, 9, 17, 31)] == [4, 8, 16, 32, 32]  # quarters of 8 rows: powers only
    assert [decode_rows(n, 12) for n in (3, 5, 7, 9)] == [4, 8, 8, 12]  # never more than the slots


def test_bfloat16_engine_matches_the_static_sampler(hf_model_dir):
    """Under bfloat16 (the pool stores the bits as uint16) greedy tokens equal the static sampler's."""
    config, params = load_hf_model(hf_model_dir("qwen2"), dtype="bfloat16")
    tokens, mask = left_padded_batch(config.vocab_size, LENGTHS, seed=2)
    greedy = SamplingConfig(max_new_tokens=20, greedy=True)
    expected = np.asarray(sample(params, config, tokens, mask, jax.random.key(0), greedy).tokens)
    out = engine_sample(small_engine(config), params, config, tokens, mask, jax.random.key(0), greedy)
    np.testing.assert_array_equal(out.tokens, expected)


def test_a_longrope_model_runs_within_its_original_context_and_is_refused_past_it(hf_model_dir):
    """Phi-3.5-style longrope (original context 16): calls that stay within it give the static sampler's greedy
    tokens (the short factors hold for every row); a call that may reach past it is refused, naming the static
    sampler, before anything is computed."""
    config, params = load_hf_model(hf_model_dir("phi3_longrope"))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 3, 1], seed=4)
    within = SamplingConfig(max_new_tokens=11, greedy=True)  # 5 + 11 = 16 positions
    expected = np.asarray(sample(params, config, tokens, mask, jax.random.key(0), within).tokens)
    engine = small_engine(config)
    np.testing.assert_array_equal(engine_sample(engine, params, config, tokens, mask, jax.random.key(0), within).tokens,
                                  expected)
    with pytest.raises(ValueError, match="original context of 16 tokens, and this call may reach 17.*engine=static"):
        engine_sample(engine, params, config, tokens, mask, jax.random.key(0), SamplingConfig(max_new_tokens=12))
    assert engine.allocator.in_use() == 0 and engine.allocator.reserved == 0


def test_past_a_longrope_context_the_paged_sampler_hands_the_call_to_the_static_one(hf_model_dir, capsys):
    """`make_sampler("paged")` of a longrope model (what `train.py`, `eval` and `generate` call) is the one place
    the choice is made (`LongContextHandover`, named in the run's header): a call past the original context is
    sampled by the static sampler, whose greedy tokens it returns, saying so once in a line; calls within it stay
    on the engine (which then holds the pool). The engine's own sampler never hands a call over: it refuses it."""
    from jaxrl_llm.engine import LongContextHandover, PagedSampler, make_sampler
    from jaxrl_llm.errors import ConfigError
    from jaxrl_llm.sharding import make_mesh

    config, params = load_hf_model(hf_model_dir("phi3_longrope"))
    tokens, mask = left_padded_batch(config.vocab_size, [5, 3, 1], seed=4)
    past = SamplingConfig(max_new_tokens=20, greedy=True)  # reaches 25 > 16
    sampler = make_sampler("paged", config)
    assert isinstance(sampler, LongContextHandover) and sampler.keeps_conversations
    assert sampler.describe(make_mesh()).endswith("original context of 16 tokens: the static sampler")
    with pytest.raises(ConfigError, match="original context of 16 tokens, and this call may reach 25"):
        PagedSampler(config)(params, tokens, mask, jax.random.key(0), past)
    expected = np.asarray(sample(params, config, tokens, mask, jax.random.key(0), past).tokens)
    for _ in range(2):
        np.testing.assert_array_equal(sampler(params, tokens, mask, jax.random.key(0), past).tokens, expected)
    err = capsys.readouterr().err
    assert err.count("the static sampler samples such calls") == 1 and "may reach 25" in err
    assert sampler.engine is None  # no engine was built for those calls
    within = SamplingConfig(max_new_tokens=11, greedy=True)
    sampler(params, tokens, mask, jax.random.key(0), within)
    assert sampler.engine is not None


def test_a_pool_too_small_for_one_request_says_so(hf_model_dir):
    config, params = load_hf_model(hf_model_dir("llama"))
    engine = small_engine(config, num_pages=4)
    with pytest.raises(RuntimeError, match="cannot hold one request"):
        engine.generate(params, [Request(list(range(1, 30)), jax.random.key(0))], SamplingConfig(max_new_tokens=8))


def test_page_allocator_counts_references():
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    assert 0 not in pages and alloc.available() == 2
    alloc.share(pages[:2])
    alloc.release(pages)
    assert alloc.in_use() == 2  # the shared two are still read
    alloc.release(pages[:2])
    assert alloc.in_use() == 0
    alloc.reserve(4)
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    assert len(alloc.allocate(4, reserved=True)) == 4 and alloc.reserved == 0
    with pytest.raises(ValueError, match="released more often"):
        alloc.release([pages[2], pages[2]])


def test_a_grpo_rollout_through_the_engine_is_the_engines_samples(tiny_task, tmp_path):
    """`sampling.engine=paged`: the GRPO rollout's tokens and log-probs are the engine's for its prompts (row keys
    `fold_in(key, prompt)`), the update trains on them, and the pool is empty after the step."""
    from jaxrl_llm.data import DataState
    from jaxrl_llm.trainers import make_trainer
    from tests.runs import tiny_run

    trainer = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "run", "data.eval=", "sampling.engine=paged",
                                    "sampling.max_new_tokens=8", "optim.warmup_steps=0", task=tiny_task,
                                    rewards=[{"name": "tests.runs:completion_length"}]))  # varies within groups
    policy, key = trainer.algorithm.policy, jax.random.key(3)
    collected = trainer.algorithm.collect(trainer.state, DataState(), key)
    ro = collected.batch
    params = policy.inference_weights(trainer.state["params"])
    direct = engine_sample(small_engine(policy.model_config), params, policy.model_config, ro.prompt_tokens[::4],
                           ro.prompt_mask[::4], key, policy.sampling_config(n=4))
    np.testing.assert_array_equal(np.asarray(ro.out.tokens), direct.tokens)
    np.testing.assert_allclose(np.asarray(ro.out.logprobs), direct.logprobs, atol=1e-6)
    assert policy.engine.allocator.in_use() == 0 and np.asarray(ro.rewards).std() > 0
    before = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
    after = trainer.algorithm.update(trainer.state, ro, 1, jax.random.key(4)).state["params"]
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(after), strict=True))


def test_the_engine_programs_lower_for_cuda(hf_model_dir):
    """The decode and prefill programs export for CUDA from this CPU machine (bfloat16, top-p, a soft-capped family),
    so a GPU run does not find a CPU-only construct first."""
    import jax.numpy as jnp

    from jaxrl_llm.engine.pages import init_pages
    from jaxrl_llm.engine.programs import SamplingFlags, SlotState, decode_program, prefill_program, prepare_weights
    from jaxrl_llm.sampling.config import knobs_from_config

    config, params = load_hf_model(hf_model_dir("gemma2"), dtype="bfloat16")
    weights, pages, slots, width = prepare_weights(params, config), init_pages(config, 16, 4), 4, 4
    state = SlotState(jnp.zeros(slots, jnp.int32), jnp.zeros(slots, jnp.int32), jnp.zeros((slots, width), jnp.int32),
                      jnp.zeros((slots, 2), jnp.uint32), jnp.zeros(slots, jnp.int32), jnp.ones(slots, jnp.int32),
                      jnp.ones(slots, bool))
    knobs = knobs_from_config(SamplingConfig(max_new_tokens=4, top_p=0.9))
    flags = SamplingFlags(greedy=False, top_k=False, top_p=True, min_p=False, eos_ids=(1,), pad_id=0)
    decode = jax.export.export(decode_program, platforms=["cuda"])(params, weights, pages, state, knobs,
                                                                   config=config, flags=flags, steps=4)
    prefill = jax.export.export(prefill_program, platforms=["cuda"])(
        params, weights, pages, jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32),
        jnp.zeros((2, width), jnp.int32), jnp.zeros(2, jnp.int32), config=config)
    assert decode.platforms == prefill.platforms == ("cuda",)
    assert "stablehlo.while" in decode.mlir_module()  # the steps run on the device, not from the host


def test_held_out_evaluation_follows_the_runs_sampler(tiny_task, tmp_path):
    """With `sampling.engine=paged` the held-out greedy evaluation samples through the engine too (one sampler for
    a run) and scores exactly what the static sampler's evaluation scores (greedy: the same tokens)."""
    from jaxrl_llm.trainers import make_trainer
    from jaxrl_llm.trainers.evaluation import GreedyEvaluation
    from tests.runs import tiny_run

    trainer = make_trainer(tiny_run("grpo_arithmetic", tmp_path / "run", "sampling.engine=paged",
                                    "sampling.max_new_tokens=8", task=tiny_task))
    policy = trainer.algorithm.policy
    params = policy.inference_weights(trainer.state["params"])
    evaluation = GreedyEvaluation(policy, batch_size=16)
    paged = evaluation(params, 16)
    assert policy.engine is not None and policy.engine.stats.prefilled_tokens > 0  # it went through the engine
    policy.config.sampling.engine = "static"
    assert evaluation(params, 16) == paged


def test_make_sampler_is_where_a_name_becomes_a_sampler(hf_model_dir):
    """`make_sampler("static" | "paged", ...)`: both implement `sampling.Sampler` (the call, `keeps_conversations`),
    give the same greedy tokens and log-probs; an unknown name is refused naming the two. No other module of the
    library turns `sampling.engine`'s value into a sampler (they call the interface)."""
    import re

    from jaxrl_llm.engine import PagedSampler, make_sampler
    from jaxrl_llm.sampling import StaticSampler
    from jaxrl_llm.sharding import make_mesh

    config, params = load_hf_model(hf_model_dir("llama"))
    tokens, mask = left_padded_batch(config.vocab_size, [6, 2, 4], seed=5)
    greedy = SamplingConfig(max_new_tokens=7, greedy=True, n=2)
    static, paged = make_sampler("static", config), make_sampler("paged", config, page_size=8)
    assert isinstance(static, StaticSampler) and not static.keeps_conversations
    assert isinstance(paged, PagedSampler) and paged.keeps_conversations and paged.page_size == 8
    assert static.describe(None) == "the static sampler"
    assert paged.describe(make_mesh()).startswith("the rollout engine")
    with pytest.raises(ValueError, match="the static sampler keeps no conversations"):
        static.conversations([(6, 7)], 2)
    a, b = (s(params, tokens, mask, jax.random.key(0), greedy) for s in (static, paged))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logprobs_untruncated), np.asarray(b.logprobs_untruncated), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(sample(params, config, tokens, mask,
                                                                          jax.random.key(0), greedy).tokens))
    with pytest.raises(ValueError, match="unknown sampler 'vllm'; expected one of static, paged"):
        make_sampler("vllm", config)
    root = ROOT / "jaxrl_llm"
    branching = re.compile(r"""engine\s*[!=]=\s*["'](paged|static)["']""")
    found = [str(p.relative_to(root)) for p in root.rglob("*.py") if branching.search(p.read_text())]
    assert found == ["cli/plan.py"], found  # the planner sizes the engine's pool, a plan and not a sampler


@pytest.mark.parametrize("query_chunk", [0, 16])
def test_a_long_prompts_prefill_chunk_holds_no_query_by_context_mask(hf_model_dir, query_chunk):
    """The XLA prefill (GPU, TPU, an engine without the CPU kernel) of a 64-token chunk into a 512-slot context in
    query chunks of 16 holds no array with both a 64-wide and a 512-wide axis (no `[R, T, context]` mask, no
    `[R, H, T, context]` scores): the mask is the positions, built a query chunk at a time; without chunks there is
    one (the check sees it). Gemma 2: a sliding window and a soft cap on the path."""
    from jaxrl_llm.engine.model import paged_forward
    from jaxrl_llm.engine.pages import init_pages
    from jaxrl_llm.engine.programs import prepare_weights

    config, params = load_hf_model(hf_model_dir("gemma2"))
    config = config.replace(attention_query_chunk=query_chunk)
    t, context, page_size = 64, 512, 8
    weights, pages = prepare_weights(params, config), init_pages(config, context // page_size + 1, page_size)
    tokens = jnp.zeros((1, t), jnp.int32)
    positions = jnp.arange(100, 100 + t, dtype=jnp.int32)[None]
    table = jnp.arange(1, context // page_size + 1, dtype=jnp.int32)[None]
    jaxpr = jax.make_jaxpr(lambda pages: paged_forward(params, weights, config, tokens, positions, table, pages))(pages)
    wide = [v.aval.shape for e in _all_eqns(jaxpr.jaxpr) for v in e.outvars
            if t in getattr(v.aval, "shape", ()) and context in getattr(v.aval, "shape", ())]
    assert (wide == []) == (query_chunk > 0), wide


def _all_eqns(jaxpr: jax.extend.core.Jaxpr) -> list:
    """The equations of `jaxpr` and of every jaxpr inside it."""
    out = list(jaxpr.eqns)
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    out += _all_eqns(inner)
    return out


def test_a_prompt_longer_than_the_unrolled_length_prefills_in_key_blocks(hf_model_dir):
    """A 600-token prompt (contexts past `attention.UNROLLED_LENGTH`: the XLA prefill attends in key blocks,
    `blocked_attention`, skipping the blocks past every row's position) in chunks of 256: the static sampler's
    greedy tokens and log-probs. Gemma 2: a window of 8 on alternate layers and soft caps on that path."""
    from jaxrl_llm.models.attention import UNROLLED_LENGTH

    config, params = load_hf_model(hf_model_dir("gemma2"))
    config = config.replace(max_position_embeddings=1024, attention_query_chunk=64)
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, config.vocab_size, (1, 600)).astype(np.int32)
    mask = np.ones_like(tokens)
    greedy = SamplingConfig(max_new_tokens=4, greedy=True)
    expected = sample(params, config, tokens, mask, jax.random.key(0), greedy)
    engine = small_engine(config, attention="xla", num_pages=200, page_size=8, prefill_chunk=256)
    out = engine_sample(engine, params, config, tokens, mask, jax.random.key(0), greedy)
    assert engine.attention == "xla" and 600 > UNROLLED_LENGTH
    np.testing.assert_array_equal(out.tokens, np.asarray(expected.tokens))
    np.testing.assert_allclose(out.logprobs_untruncated, np.asarray(expected.logprobs_untruncated), atol=1e-4)
