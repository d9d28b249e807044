"""The memory planner (`jaxrl_llm.memory_plan`, printed by `python -m jaxrl_llm plan`): its byte counts against live
sharded arrays on 8 virtual devices, a hand-computed case, the command line, and the activation estimate against
XLA's compiled train step."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxrl_llm import memory_plan as plan
from jaxrl_llm.cli import plan as plan_cli
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import param_shapes
from jaxrl_llm.models.hf import config_from_hf
from tests.xla_settings import virtual_devices_xla_flags

REPO = Path(__file__).resolve().parents[1]

# (name, HF config, mesh, prompts, group size, prompt length, new tokens)
LIVE_CASES = [
    # Every dimension divisible by its mesh axes: everything really is sharded.
    ("divisible", dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
     (2, 2, 2), 4, 2, 8, 8),
    # Odd vocabulary (embedding / LM head stay whole on `tensor`), odd intermediate size (MLP replicated on
    # `tensor`), one KV head and 6 sequences on data*fsdp = 4 (the KV cache replicated): the fit fallback.
    ("fallback", dict(model_type="qwen2", vocab_size=97, hidden_size=36, intermediate_size=45, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=False),
     (1, 4, 2), 3, 2, 5, 7),
    # A mixture of experts on (data, fsdp, expert, tensor) = (1, 2, 2, 2): each device holds 4 of the 8 experts.
    ("experts", dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                     moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
     (1, 2, 2, 2), 4, 2, 8, 8),
]

_MEASURE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding
from jaxrl_llm import sharding
from jaxrl_llm.config import OptimSection
from jaxrl_llm.models.decoder import param_shapes
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.memory_plan import KV_CACHE_SPEC
from jaxrl_llm.optim import make_optimizer

assert jax.device_count() == 8, jax.devices()
out = {}
for name, hf, mesh_sizes, sequences, cache_len in json.loads(sys.argv[1]):
    config = config_from_hf(hf)
    mesh = sharding.make_mesh(mesh_sizes)
    # Host arrays placed by the trainer's path (`shard_params`); values do not matter, and a (slow, eager) Flax
    # init would only cost time.
    params = sharding.shard_params(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), param_shapes(config)), mesh)
    shardings = sharding.param_shardings(params, mesh)
    grads = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p), out_shardings=shardings)(params)
    optimizer = make_optimizer(OptimSection(), 10)[0]
    state_shardings = sharding.optimizer_state_shardings(
        optimizer, jax.eval_shape(optimizer.init, params), shardings, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=state_shardings)(params)
    shape = (config.num_layers, sequences, cache_len, config.num_kv_heads, config.head_dim)
    cache_sharding = NamedSharding(mesh, sharding.fit_spec(KV_CACHE_SPEC, shape, mesh))
    cache = jax.jit(lambda: {"k": jnp.zeros(shape, config.jnp_dtype), "v": jnp.zeros(shape, config.jnp_dtype)},
                    out_shardings={"k": cache_sharding, "v": cache_sharding})()
    out[name] = dict(params=sharding.local_bytes(params), gradients=sharding.local_bytes(grads),
                     optimizer=sharding.local_bytes(opt_state), kv_cache=sharding.local_bytes(cache),
                     total_params=sum(x.nbytes for x in jax.tree.leaves(params)))
print("RESULT" + json.dumps(out))
"""


def test_plan_matches_live_sharded_arrays_on_8_devices() -> None:
    """params, gradients, optimizer state and KV cache: the planner (no devices) equals `local_bytes` of real
    arrays placed by `jaxrl_llm.sharding` on a `(data, fsdp, tensor)` mesh of 8 virtual CPU devices."""
    plans, jobs = {}, []
    for name, hf, mesh, prompts, group, prompt_len, new in LIVE_CASES:
        p = plan.plan_memory(config_from_hf(hf), mesh, batch=prompts, group_size=group, prompt_len=prompt_len,
                             new_tokens=new)
        plans[name] = p
        jobs.append((name, hf, mesh, prompts * group, p.cache_length))
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(8, fast_compile=False), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(jobs)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name, p in plans.items():
        m = measured[name]
        for group in ("params", "gradients", "optimizer", "kv_cache"):
            # Exact (well inside the 10% the planner promises): shapes and placements are deterministic.
            assert getattr(p, group) == m[group], (name, group, getattr(p, group), m[group])
    # Sharding really happened in the divisible case (8 devices, parameters over fsdp x tensor = 4 ways) ...
    assert measured["divisible"]["params"] < measured["divisible"]["total_params"] / 3
    assert plans["divisible"].rollout_rows == 2  # 8 sequences over data*fsdp = 4
    # ... and the fallback case kept the undividable dimensions whole.
    fallback = plans["fallback"]
    assert fallback.rollout_rows == 6  # 6 sequences do not split 4 ways
    assert measured["fallback"]["total_params"] / 8 < fallback.params < measured["fallback"]["total_params"] / 2
    # The experts split 2 ways over `expert` on top of fsdp x tensor (the rest 4 ways or whole): under a fifth.
    assert measured["experts"]["params"] < measured["experts"]["total_params"] / 5


def _hand_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=4)
    return ModelConfig(**{**fields, **overrides})


def test_hand_computed_plan_on_one_device() -> None:
    """Parameter count and every byte count by hand for a 3-layer model on a 1x1x1 mesh."""
    # embed 100*16 + 3 layers * (q 16*16 + k,v 2*16*8 + o 16*16 + gate,up,down 3*16*32 + 2 norms 2*16)
    # + final norm 16 + lm_head 16*100
    n = 100 * 16 + 3 * (256 + 256 + 256 + 1536 + 32) + 16 + 1600
    assert n == 10224 == _hand_config().num_params()
    p = plan.plan_memory(_hand_config(), (1, 1, 1), batch=2, group_size=3, prompt_len=5, new_tokens=7)
    assert p.num_params == n
    assert p.params == 4 * n and p.gradients == 4 * n and p.reference == 0
    assert p.optimizer == 2 * 4 * n + 17  # mu + nu, plus 4 counters (int32) and a bool
    # KV cache: 2 (k, v) * L * (B*n) * (prompt + new) * KVH * hd * 4 bytes.
    assert p.kv_cache == 2 * 3 * 6 * 12 * 2 * 4 * 4
    assert p.cache_length == 12 and p.rollout_rows == 6 and p.micro_rows == 6 and p.train_seq_len == 11
    # Sampler copy: q|k|v [16, 32] and gate|up [16, 64] per layer (o and down are used in place).
    assert p.sampler_weights == 3 * (16 * 32 + 16 * 64) * 4
    assert p.gradient_buffers == 2  # the accumulator and the optimizer's update tree (no micro-batches)
    assert p.total == p.persistent + max(p.kv_cache + p.sampler_weights, 2 * p.gradients + p.activations)

    # bfloat16 parameters and compute, a reference copy, length buckets and micro-batches.
    q = plan.plan_memory(_hand_config(param_dtype="bfloat16", dtype="bfloat16", remat=True), (1, 1, 1), batch=2,
                         group_size=3, prompt_len=5, new_tokens=7, reference=True, prompt_bucket=8,
                         new_tokens_bucket=8, grad_accum=3)
    # bf16 parameters train through a float32 master (and float32 AdamW moments); the reference is bf16.
    assert q.params == 4 * n and q.reference == 2 * n and q.optimizer == 2 * 4 * n + 17 and q.gradients == 4 * n
    assert q.kv_cache == 2 * 3 * 6 * 16 * 2 * 4 * 2 and q.micro_rows == 2 and q.train_seq_len == 8 + 7 - 1
    assert q.activations == q.activations_remat < q.activations_no_remat
    # float32 parameters, bfloat16 compute: the cache and the sampler's copy (now o and down too) in 2 bytes.
    m = plan.plan_memory(_hand_config(dtype="bfloat16"), (1, 1, 1), batch=2, group_size=3, prompt_len=5,
                         new_tokens=7)
    assert m.params == 4 * n and m.kv_cache == p.kv_cache // 2
    assert m.sampler_weights == 3 * (16 * 32 + 16 * 64 + 16 * 16 + 32 * 16) * 2
    # On a (1, 2, 2) mesh everything above splits in four (all dims divisible) and the cache in two x two.
    r = plan.plan_memory(_hand_config(), (1, 2, 2), batch=2, group_size=3, prompt_len=5, new_tokens=7)
    assert r.kv_cache * 4 == p.kv_cache and r.rollout_rows == 3
    # The sampler's copy is gathered over fsdp (o and down now copied too), split over tensor.
    assert r.sampler_weights == 3 * (16 * 32 + 16 * 64 + 16 * 16 + 32 * 16) * 4 // 2
    norms = 2 * 3 * 16 + 16  # the norm scales stay replicated
    assert r.params == 4 * ((n - norms) // 4 + norms)
    # A library user's own optax transformation: Lion keeps one moment and a count, plain SGD nothing.
    kw = dict(batch=2, prompt_len=5, new_tokens=7)
    assert plan.plan_memory(_hand_config(), (1, 1, 1), optimizer=optax.lion(1e-4), **kw).optimizer == 4 * n + 4
    assert plan.plan_memory(_hand_config(), (1, 1, 1), optimizer=optax.sgd(1e-3), **kw).optimizer == 0
    with pytest.raises(ValueError, match="grad_accum"):
        plan.plan_memory(_hand_config(), (1, 1, 1), batch=2, group_size=3, prompt_len=5, new_tokens=7, grad_accum=4)


def test_shard_shape_agrees_with_jax() -> None:
    """`shard_shape` equals `NamedSharding.shard_shape` for every parameter of a model on a 2x2x2 mesh."""
    config = _hand_config(vocab_size=97)  # embedding rows do not split over tensor
    shapes = param_shapes(config)
    sizes = plan.axis_sizes_of((2, 2, 2))
    mesh = plan.abstract_mesh(sizes)
    specs = plan.param_partition_specs(shapes, sizes)
    for x, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, plan.P)),
                       strict=True):
        assert plan.shard_shape(x.shape, spec, sizes) == jax.sharding.NamedSharding(mesh, spec).shard_shape(x.shape)
    assert plan.fit_spec_sizes(plan.P("tensor", "fsdp"), (97, 16), sizes) == plan.P(None, "fsdp")
    with pytest.raises(ValueError, match="not divisible"):
        plan.shard_shape((97, 16), plan.P("tensor", None), sizes)


def test_parsers() -> None:
    assert plan_cli.parse_mesh("data=2,fsdp=2,tensor=2") == (2, 2, 1, 2)  # (data, fsdp, expert, tensor)
    assert plan_cli.parse_mesh("fsdp=8") == (1, 8, 1, 1)
    assert plan_cli.parse_mesh("4,1,2") == (4, 1, 1, 2)
    assert plan_cli.parse_mesh("data=2,expert=4") == (2, 1, 4, 1)
    assert plan_cli.parse_mesh("1,2,2,2") == (1, 2, 2, 2)
    assert plan_cli.parse_mesh_axes("data=2,sequence=4") == ((2, 1, 1, 1), 4)
    assert plan_cli.parse_mesh_axes("2,1,2") == ((2, 1, 1, 2), 1)
    for bad in ("data=2,pipeline=2", "2,2", "fsdp=0", "sequence=0"):
        with pytest.raises(ValueError):
            plan_cli.parse_mesh(bad)
    assert plan_cli.parse_bytes("80GiB") == 80 * 2**30
    assert plan_cli.parse_bytes("16GB") == plan_cli.parse_bytes("16G") == 16 * 10**9
    assert plan_cli.parse_bytes("1.5 KiB") == 1536 and plan_cli.parse_bytes("123") == 123
    with pytest.raises(ValueError):
        plan_cli.parse_bytes("lots")
    assert plan_cli.format_bytes(3 * 2**30) == "3.00 GiB" and plan_cli.format_bytes(-512) == "-512 B"


def test_cli_on_committed_model_fits_and_does_not_fit() -> None:
    """`python -m jaxrl_llm plan` on `models/arith-base`: FITS in 80 GiB, DOES NOT FIT in 1 MiB, exit 0."""
    base = [sys.executable, "-m", "jaxrl_llm", "plan", "--model", "models/arith-base", "--mesh",
            "data=2,fsdp=2,tensor=2", "--batch", "64", "--prompt-len", "256", "--new-tokens", "512", "--reference"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for memory, verdict in (("80GiB", "FITS"), ("1MiB", "DOES NOT FIT")):
        proc = subprocess.run([*base, "--device-memory", memory], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        last = proc.stdout.strip().splitlines()[-1]
        assert last.startswith(verdict + ":"), proc.stdout
        for row in ("params (policy)", "reference params", "optimizer state", "gradients", "KV cache",
                    "activations", "total"):
            assert row in proc.stdout, (row, proc.stdout)


def test_cli_plans_a_packed_update_as_its_padded_upper_bound(capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_llm.cli.plan import main

    args = ["--model", str(REPO / "models" / "arith-base"), "--batch", "8", "--new-tokens", "32"]
    assert main(args) == 0
    padded = capsys.readouterr().out
    assert main([*args, "--packing"]) == 0
    packed = capsys.readouterr().out
    note, table = packed.split("\n", 1)
    assert note.startswith("rl.packing: the update's micro-batch is planned padded, an upper bound")
    assert table == padded and "rl.packing" not in padded


def test_cli_says_the_longest_context_on_a_sequence_axis(capsys: pytest.CaptureFixture[str]) -> None:
    """`--longest-context` prints the longest context whose step fits `--device-memory`, the same number the
    library gives; a `sequence=2` mesh is named in the table and fits a longer one."""
    from jaxrl_llm.cli.plan import main

    args = ["--model", str(REPO / "models" / "arith-base"), "--batch", "1", "--group-size", "1", "--remat",
            "--device-memory", "1GiB", "--longest-context"]
    found = {}
    for mesh in ("data=1", "data=1,sequence=2"):
        assert main([*args, "--mesh", mesh]) == 0
        out = capsys.readouterr().out
        line = out.strip().splitlines()[-1]
        assert line.startswith("longest context that fits 1.00 GiB per device:"), out
        found[mesh] = int(line.split(": ")[1].split(" tokens")[0].replace(",", ""))
        assert ("sequence=2" in out) == ("sequence" in mesh)
    assert found["data=1,sequence=2"] > found["data=1"] > 64


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_llm.cli.errors import run_command

    assert run_command("plan", plan_cli.main, ["--mesh", "data=2,pipe=2"]) == 2
    assert "plan: error: cannot read mesh" in capsys.readouterr().err
    assert run_command("plan", plan_cli.main, ["--model", "./no/such/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_hub_id_downloads_config_json_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hub id fetches config.json alone (no weights): the planner needs nothing else."""
    import huggingface_hub

    qwen = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    requested = []

    def fake_download(repo_id: str, filename: str, **kwargs: object) -> str:
        requested.append((repo_id, filename))
        return str(tmp_path / filename)

    def fake_model_info(repo_id: str, **kwargs: object) -> object:  # the quick existence check before it
        requested.append((repo_id, "model_info"))
        return object()

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub, "model_info", fake_model_info)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert plan_cli.load_hf_config_dict("Qwen/Qwen2.5-0.5B") == qwen
    assert requested == [("Qwen/Qwen2.5-0.5B", "model_info"), ("Qwen/Qwen2.5-0.5B", "config.json")]
    p = plan.plan_memory(config_from_hf(qwen), (1, 8, 1), batch=64, prompt_len=256, new_tokens=512)
    assert 494_000_000 < p.num_params < 495_000_000  # Qwen2.5-0.5B: 494M parameters (tied embeddings)
    # KV cache: 2 * 24 layers * (64/8 rows) * 768 * 2 KV heads * 64 * 4 bytes.
    assert p.kv_cache == 2 * 24 * 8 * 768 * 2 * 64 * 4


@pytest.mark.parametrize("remat", [False, True])
def test_activation_estimate_against_compiled_train_step(remat: bool) -> None:
    """`gradients + activations` vs the temp memory XLA allocates for the real (float32, one device) train step.

    The planner's coefficients were measured on XLA:CPU (float32); this asserts agreement within a factor of
    1.2 (0.95 without remat, 0.92 with it when written; the first-guess coefficients, or leaving out the
    backward's cotangents, gave 1.25), so a change of the decoder or train step that moves activation memory
    shows up here: re-measure and update `plan.activation_bytes` then.
    """
    from jaxrl_llm.config import OptimSection
    from jaxrl_llm.models.sequences import Sequences
    from jaxrl_llm.optim import make_optimizer
    from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, policy_loss
    from jaxrl_llm.trainers.step import train_step

    config = _hand_config(vocab_size=256, hidden_size=64, intermediate_size=128, remat=remat, head_dim=16)
    b, prompt_len, new = 8, 64, 32
    optimizer = make_optimizer(OptimSection(), 10)[0]
    shapes = param_shapes(config)
    ints = lambda t: jax.ShapeDtypeStruct((b, t), jnp.int32)  # noqa: E731
    floats = lambda t: jax.ShapeDtypeStruct((b, t), jnp.float32)  # noqa: E731
    batch = PolicyBatch(Sequences(ints(prompt_len), ints(prompt_len), ints(new), ints(new)), floats(new), floats(new),
                        jax.ShapeDtypeStruct((b,), jnp.float32))
    step = functools.partial(train_step, loss_fn=policy_loss, model_config=config, loss_config=PolicyObjective(),
                             optimizer=optimizer, grad_accum=1)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(shapes, jax.eval_shape(optimizer.init, shapes),
                                                          batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    p = plan.plan_memory(config, (1, 1, 1), batch=b, prompt_len=prompt_len, new_tokens=new)
    ratio = temp / p.update
    assert 1 / 1.2 < ratio < 1.2, (temp, p.gradients, p.activations, ratio)


def test_lora_plan_counts_adapters_against_live_arrays() -> None:
    """LoRA: the base in param_dtype plus float32 adapters, adapter-sized gradients and AdamW moments, no reference
    copy, and one merged weight copy; the adapter bytes equal what `init_adapters` really allocates."""
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.lora import LoraSpec, init_adapters

    config = _hand_config(param_dtype="bfloat16")
    kw = dict(batch=2, group_size=3, prompt_len=5, new_tokens=7)
    full = plan.plan_memory(config, (1, 1, 1), reference=True, **kw)
    lora = plan.plan_memory(config, (1, 1, 1), reference=True, lora_rank=4, lora_targets="(q|v)_proj", **kw)
    params = init_params(config, jax.random.key(0))
    adapters = init_adapters(params, LoraSpec(4, 8.0, "(q|v)_proj"), jax.random.key(1))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(params))  # bf16 working weights
    assert lora.params == base_bytes + adapter_bytes
    assert lora.gradients == adapter_bytes and lora.reference == 0 and lora.merged == base_bytes
    scalars = full.optimizer - 2 * 4 * full.num_params  # AdamW's counters and flags, beside mu and nu
    assert lora.optimizer == 2 * adapter_bytes + scalars  # mu and nu of the adapters only
    assert lora.trainable == sum(x.size for x in jax.tree.leaves(adapters))
    assert lora.total < full.total


def test_engine_plan_counts_the_engines_pool_and_slot_caches() -> None:
    """With `engine_page_size`, the sampler's memory is the rollout engine's: the pool a run sizes for its step
    (`samplers.ThreadSamplers.rollout_engine`) and the contiguous caches one decode call gathers for every slot, as
    allocated."""
    from jaxrl_llm.engine import Engine
    from jaxrl_llm.engine.model import slot_caches
    from jaxrl_llm.engine.pages import table_width

    config = config_from_hf(dict(LIVE_CASES[0][1]), dtype="bfloat16")
    prompts, group, prompt_len, new, size = 3, 4, 21, 30, 8
    pages = 1 + sum(-(-prompt_len // size) + group * -(-(prompt_len + new) // size) for _ in range(prompts))
    engine = Engine(config, num_pages=pages, page_size=size, slots=prompts * group)
    pool = sum(a.nbytes for layer in engine.pages for a in layer.values())
    width = table_width(-(-(prompt_len + new) // size), size)  # the widest decode call's page table
    table = jax.ShapeDtypeStruct((prompts * group, width), jnp.int32)
    caches = jax.eval_shape(slot_caches, engine.pages, table)
    gathered = sum(a.size * a.dtype.itemsize for layer in caches for a in layer.values())
    got = plan.plan_memory(config, (1, 1, 1), batch=prompts, group_size=group, prompt_len=prompt_len,
                           new_tokens=new, engine_page_size=size)
    assert got.kv_cache == pool + gathered
    static = plan.plan_memory(config, (1, 1, 1), batch=prompts, group_size=group, prompt_len=prompt_len,
                              new_tokens=new)
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # keys and values, bfloat16
    assert static.kv_cache == prompts * group * (prompt_len + new) * kv_per_token
    assert got.kv_cache == (pages * size + prompts * group * width * size) * kv_per_token
    # A kernel reading the pages (GPU, TPU, the CPU's C++ one): the pool alone.
    kernel = plan.plan_memory(config, (1, 1, 1), batch=prompts, group_size=group, prompt_len=prompt_len,
                              new_tokens=new, engine_page_size=size, engine_slot_caches=False)
    assert kernel.kv_cache == pool
    # On a (2, 2, 2) mesh: one engine per (data, fsdp) position, each with a quarter of the pool and of the 12 slots,
    # its KV heads halved over its two tensor devices.
    assert config.num_kv_heads % 2 == 0 and (prompts * group) % 4 == 0
    on_mesh = plan.plan_memory(config, (2, 2, 2), batch=prompts, group_size=group, prompt_len=prompt_len,
                               new_tokens=new, engine_page_size=size)
    assert on_mesh.kv_cache == (-(-pages // 4) * size + prompts * group // 4 * width * size) * kv_per_token // 2


def test_the_plan_counts_slot_caches_only_where_the_engine_decodes_on_the_xla_path() -> None:
    """`plan`: the slot caches are planned for `sampling.engine_attention=xla`, engines of several `tensor` devices
    (a mesh's or the sampler mesh's), and a sliding-window model unless the attention is the CPU kernel (the Pallas
    kernels have no window); not for a kernel on one device, nor on a mesh of one-device shards."""
    from jaxrl_llm.cli.plan import slot_caches_planned

    plain = config_from_hf(dict(LIVE_CASES[0][1]))
    windowed = dataclasses.replace(plain, sliding_window=8)
    one, eight = dict(mesh=(1, 1, 1), sampler_mesh=None), dict(mesh=(8, 1, 1), sampler_mesh=None)
    assert not slot_caches_planned(plain, {**one, "engine_attention": "auto"})
    assert not slot_caches_planned(plain, {**one, "engine_attention": "cpu"})
    assert slot_caches_planned(plain, {**one, "engine_attention": "xla"})
    assert not slot_caches_planned(plain, {**eight, "engine_attention": "auto"})  # 8 engines of one device each
    assert slot_caches_planned(plain, {**eight, "mesh": (4, 1, 2), "engine_attention": "auto"})
    assert slot_caches_planned(plain, {**eight, "sampler_mesh": (1, 1, 2), "engine_attention": "auto"})
    assert slot_caches_planned(windowed, {**one, "engine_attention": "auto"})
    assert not slot_caches_planned(windowed, {**one, "engine_attention": "cpu"})


def test_a_distillation_teacher_is_counted(capsys):
    """`--algo distill`: the teacher's frozen weights (its own architecture, param_dtype) live through the step, and
    under the JSD loss its hidden states of a micro-batch are part of the update."""
    student = config_from_hf(dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    teacher = config_from_hf(dict(model_type="llama", vocab_size=101, hidden_size=96, intermediate_size=256,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4))
    kwargs = dict(batch=4, group_size=2, prompt_len=10, new_tokens=7)
    alone = plan.plan_memory(student, (1, 1, 1), **kwargs)
    with_teacher = plan.plan_memory(student, (1, 1, 1), teacher=teacher, **kwargs)
    jsd = plan.plan_memory(student, (1, 1, 1), teacher=teacher, teacher_in_update=True, **kwargs)
    assert with_teacher.teacher == 4 * teacher.num_params()  # float32 weights
    assert with_teacher.persistent - alone.persistent == with_teacher.teacher
    assert jsd.update - with_teacher.update == 8 * (10 + 7 - 1) * 96 * 4  # [rows, T, D_teacher] float32
    root = Path(__file__).resolve().parents[1]
    assert plan_cli.main(["--config", str(root / "configs" / "distill_arithmetic.yaml")]) == 0
    assert "teacher params (distill)" in capsys.readouterr().out


def test_a_token_budget_is_planned_as_the_packed_rows_it_fills():
    """rl.max_tokens_per_microbatch: the micro-batch is the packed rows of the padded length S that the budget's
    tokens fill, at first-fit decreasing's bound: ceil(11/9 * ceil(B / S)) + 1 rows, never more than the minibatch."""
    config = config_from_hf(dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    kwargs = dict(batch=16, group_size=8, prompt_len=64, new_tokens=256)
    budget = plan.plan_memory(config, (1, 1, 1), max_tokens_per_microbatch=4096, **kwargs)
    assert budget.micro_rows == 17  # S = 319: ceil(4096 / 319) = 13 rows, x 11/9 -> 16, + 1
    assert budget.activations < plan.plan_memory(config, (1, 1, 1), **kwargs).activations
    assert plan.plan_memory(config, (1, 1, 1), max_tokens_per_microbatch=10**6, **kwargs).micro_rows == 128


def test_sampling_beside_training_counts_the_weight_copies_and_the_sampler_mesh(capsys):
    """`rollout.max_staleness` K: K + 1 inference-weight copies (as many bytes as the live bf16 weights) beside both
    programs on one mesh; with `rollout.sampler_devices`, the trainer's devices hold no rollout and the sampler's hold
    the copies, their share of the KV cache and the decode copy."""
    from jaxrl_llm.models.decoder import init_params

    config = _hand_config(param_dtype="bfloat16")
    kw = dict(batch=2, group_size=4, prompt_len=5, new_tokens=7, reference=True)
    copy = sum(x.nbytes for x in jax.tree.leaves(init_params(config, jax.random.key(0))))
    sync = plan.plan_memory(config, (1, 1, 1), **kw)
    assert sync.weight_copies == 0 and sync.total == sync.persistent + max(sync.rollout, sync.update)
    beside = plan.plan_memory(config, (1, 1, 1), max_staleness=2, **kw)
    assert beside.weight_copies == 3 * copy
    assert beside.total == sync.persistent + 3 * copy + sync.rollout + sync.update
    split = plan.plan_memory(config, (1, 1, 1), max_staleness=1, sampler_mesh_sizes=(2, 1, 1), **kw)
    assert split.total == sync.persistent + sync.update and split.weight_copies == 2 * copy
    assert split.sampler_kv_cache == sync.kv_cache // 2  # 8 rows over the sampler's 2 data devices
    assert split.sampler_total == 2 * copy + sync.kv_cache // 2 + sync.sampler_weights
    assert split.margin(10 ** 9) == 10 ** 9 - max(split.total, split.sampler_total)
    tensor = plan.plan_memory(config, (1, 1, 1), max_staleness=1, sampler_mesh_sizes=(1, 1, 2), **kw)
    assert copy < tensor.weight_copies < 2 * copy  # the matrices split over 2, the norms replicated
    root = Path(__file__).resolve().parents[1]
    assert plan_cli.main(["--config", str(root / "configs" / "grpo_arithmetic.yaml"), "--devices", "2",
                          "rollout.max_staleness=1", "rollout.sampler_devices=1"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 fsdp=1 tensor=1 (1 devices)" in out and "total, sampler" in out
    assert "inference weight copies (K+1 = 2)" in out


def test_the_packed_decode_weights_are_planned_where_the_engine_packs(monkeypatch):
    """`packed_weight_bytes` is the bytes `pack_weights` makes (K not a multiple of 32, a vocabulary not a multiple
    of 16), added to the sampler weight copy with `engine_packed_weights`; planned only for a bfloat16 model on
    engines of one CPU device with AMX and the CPU attention kernel."""
    from jaxrl_llm.cli.plan import packed_weights_planned
    from jaxrl_llm.engine import cpu_kernel
    from jaxrl_llm.engine.programs import pack_weights, prepare_weights
    from jaxrl_llm.models.decoder import init_params

    config = config_from_hf(dict(model_type="llama", vocab_size=101, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                            dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    packed = pack_weights(params, prepare_weights(params, config), config=config)
    assert plan.packed_weight_bytes(config) == sum(x.nbytes for x in jax.tree.leaves(packed) if x.ndim == 4)
    kwargs = dict(batch=4, group_size=2, prompt_len=10, new_tokens=7, engine_page_size=16)
    assert (plan.plan_memory(config, (1, 1, 1), engine_packed_weights=True, **kwargs).sampler_weights
            - plan.plan_memory(config, (1, 1, 1), **kwargs).sampler_weights) == plan.packed_weight_bytes(config)
    one = dict(mesh=(1, 1, 1), sampler_mesh=None, engine_attention="auto")
    monkeypatch.setattr(cpu_kernel, "_has_amx", lambda: True)
    assert packed_weights_planned(config, one)
    assert not packed_weights_planned(config, {**one, "engine_attention": "xla"})
    assert packed_weights_planned(config, {**one, "mesh": (2, 1, 1)})  # two engines of one device each
    assert not packed_weights_planned(config, {**one, "mesh": (1, 1, 2)})
    assert not packed_weights_planned(dataclasses.replace(config, dtype="float32"), one)
    monkeypatch.setattr(cpu_kernel, "_has_amx", lambda: False)
    assert not packed_weights_planned(config, one)


def test_a_sequence_axis_splits_the_update_positions_and_the_longest_context_is_the_last_that_fits() -> None:
    """`sequence = N`: the same parameters, optimizer and cache per device, and the update's activations, whose
    per-position terms split N ways, between 1/N and 1.4/N of one device's at a context where they dominate (the
    all-gathered keys and one query chunk's scores over every key stay whole). `longest_context`: that context
    fits and one bucket more does not; it grows with the device memory and with N."""
    config = _hand_config(hidden_size=256, intermediate_size=1024, head_dim=64, remat=True, attention_query_chunk=64)
    kw = dict(batch=1, prompt_len=16)
    one = plan.plan_memory(config, (1, 1, 1), new_tokens=8192, **kw)
    four = plan.plan_memory(config, (1, 1, 1), new_tokens=8192, sequence=4, **kw)
    assert (four.params, four.optimizer, four.kv_cache) == (one.params, one.optimizer, one.kv_cache)
    assert one.activations / 4 < four.activations < 1.4 * one.activations / 4
    memory = one.total * 4
    longest = plan.longest_context(config, (1, 1, 1), memory, **kw)
    assert plan.plan_memory(config, (1, 1, 1), new_tokens=longest - 16, **kw).fits(memory)
    assert not plan.plan_memory(config, (1, 1, 1), new_tokens=longest + 16 - 16, **kw).fits(memory)
    assert longest % 16 == 0 and longest > 8192
    assert plan.longest_context(config, (1, 1, 1), 2 * memory, **kw) > 1.5 * longest
    assert plan.longest_context(config, (1, 1, 1), memory, sequence=4, **kw) > 2 * longest
    assert plan.longest_context(config, (1, 1, 1), 1, **kw) == 0
