"""Mesh independence on 8 virtual CPU devices: one GRPO train step, greedy decoding and temperature + top-p
sampling give the one-device results on meshes (data, fsdp, tensor) = (8,1,1), (2,4,1), (2,2,2), (1,2,4);
parameters, optimizer state and checkpoint loading follow the partition rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.sharding import MeshShape, fit_spec, make_mesh, param_spec
from tests.families import TINY  # noqa: F401  (the tiny_task fixture lives in conftest)
from tests.xla_settings import virtual_devices_xla_flags

pytestmark = pytest.mark.heavy(seconds=153)

ROOT = Path(__file__).resolve().parents[1]
MESHES = ((8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4))

_SCRIPT = r"""
import json, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from jaxrl_llm.config import OptimSection
from jaxrl_llm.engine import PagedSampler
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf, load_hf_model
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.sampling import SamplingConfig, sample
from jaxrl_llm.sharding import (MeshShape, global_array, init_optimizer_state, make_mesh, param_shardings,
                                path_string, to_host)
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, completion_logprobs, policy_loss
from jaxrl_llm.rl import PolicyLossOptions
from tests.batches import random_rollout
from jaxrl_llm.trainers.step import jit_one_step_update, state_sharding
from jaxrl_llm.optim import make_optimizer

assert jax.device_count() == 8, jax.devices()
hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
      "tie_word_embeddings": False, "vocab_size": 32, "attention_bias": True}
config = config_from_hf(hf)
params = init_params(config, jax.random.key(1))
# Non-zero biases and non-unit norm scales, as in a trained checkpoint (init has them at exactly 0 and 1).
leaves, treedef = jax.tree.flatten(params)
keys = jax.random.split(jax.random.key(2), len(leaves))
params = jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
rng = np.random.default_rng(0)
n, p_len, t_len = 16, 6, 8
pt, pm, ct, cm, logp = random_rollout(params, config, rng, n, p_len, t_len)
old = (logp + rng.normal(0, 0.1, logp.shape)).astype(np.float32) * cm
ref = (logp + rng.normal(0, 0.1, logp.shape)).astype(np.float32) * cm
adv = rng.normal(0, 1, n).astype(np.float32)
from jaxrl_llm.models.sequences import Sequences
batch = PolicyBatch(Sequences(pt, pm, ct, cm), old, ref, adv)
# The same batch packed (rl.packing): 2 micro-batches of 8 sequences, rows a multiple of the 4 batch shards.
from jaxrl_llm.models.packing import update_layouts
plan = update_layouts(np.concatenate([pm, cm], 1)[:, :-1] > 0, p_len, np.arange(n)[None], 2, multiple=4)
packed_batch = batch._replace(layout=jax.tree.map(lambda x: x[0], plan.layouts))
loss_config = PolicyObjective(options=PolicyLossOptions(epsilon_low=0.1, epsilon_high=0.1, aggregation="token-mean"),
                              beta=0.1)
sampling = SamplingConfig(max_new_tokens=24, greedy=True, n=2, eos_ids=(), pad_id=0)
drawn = SamplingConfig(max_new_tokens=24, temperature=0.9, top_p=0.95, n=2, eos_ids=(), pad_id=0)
prompts_t, prompts_m = pt[:8], pm[:8]


def run(shape, grad_accum=1, packed=False, rollouts=True):
    # The mesh's update, and with `rollouts` its samplers' tokens (which the tests compare with one device's).
    devices = jax.devices()[:1] if shape is None else jax.devices()
    mesh = make_mesh(MeshShape(1, 1, 1) if shape is None else MeshShape(*shape), devices)
    shardings = param_shardings(params, mesh)
    placed = jax.device_put(jax.tree.map(jnp.copy, params), shardings)
    optimizer, _ = make_optimizer(OptimSection(learning_rate=1e-2), 10)
    opt_state = init_optimizer_state(optimizer, placed, shardings, mesh)
    update = jit_one_step_update(mesh, state_sharding({"params": placed, "opt_state": opt_state}), loss_fn=policy_loss,
                                 model_config=config, loss_config=loss_config, optimizer=optimizer,
                                 grad_accum=grad_accum)
    if not rollouts:
        state, _ = update({"params": placed, "opt_state": opt_state}, jax.tree.map(lambda x: global_array(x, mesh),
                          batch), jax.random.key(0), None)
        return {"params": to_host(state["params"])}
    greedy = to_host(sample(placed, config, prompts_t, prompts_m, jax.random.key(0), sampling, mesh=mesh))
    sampled = to_host(sample(placed, config, prompts_t, prompts_m, jax.random.key(4), drawn, mesh=mesh))
    # The rollout engine on the same mesh (one decode call a generate: few programs to compile; refills and page
    # growth are tested on one device, tests/engine/test_engine.py).
    paged = PagedSampler(config, page_size=8, steps_per_call=32)
    engine_greedy = to_host(paged(placed, prompts_t, prompts_m, jax.random.key(0), sampling))
    engine_sampled = to_host(paged(placed, prompts_t, prompts_m, jax.random.key(4), drawn))
    engines = getattr(paged.engine, "engines", [paged.engine])  # one per data-parallel shard on a mesh
    pools = [layer[name] for e in engines for layer in e.pages for name in ("k", "v")]
    per_device: dict = {}
    for pool in pools:  # the pool bytes each device holds, read from the arrays' shards
        for piece in pool.addressable_shards:
            per_device[piece.device.id] = per_device.get(piece.device.id, 0) + piece.data.nbytes
    specs = {path_string(k): str(tuple(v.sharding.spec)) for k, v in jax.tree_util.tree_flatten_with_path(placed)[0]}
    mu_specs = {path_string(k): str(tuple(v.sharding.spec))
                for k, v in jax.tree_util.tree_flatten_with_path(opt_state.inner_state[1][0].mu)[0]}
    state, m = update({"params": placed, "opt_state": opt_state},
                      jax.tree.map(lambda x: global_array(x, mesh), packed_batch if packed else batch),
                      jax.random.key(0), None)
    new = state["params"]
    return {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "kl": float(m.get("kl", 0.0)),
            "params": to_host(new), "tokens": np.asarray(greedy.tokens).tolist(), "specs": specs,
            "mu_specs": mu_specs, "sampled": np.asarray(sampled.tokens).tolist(),
            "sampled_logprobs": np.asarray(sampled.logprobs).tolist(),
            "engine_tokens": np.asarray(engine_greedy.tokens).tolist(),
            "engine_sampled": np.asarray(engine_sampled.tokens).tolist(),
            "engine_logprobs": np.asarray(engine_sampled.logprobs).tolist(),
            "engine_pool": {"spec": str(tuple(engines[0].pages[0]["k"].sharding.spec)),
                            "shards": len(engines), "devices": sorted(per_device),
                            "per_device_bytes": sorted(set(per_device.values())),
                            "total_bytes": sum(x.nbytes for x in pools),
                            "attention": sorted({e.attention for e in engines}),
                            "decode_calls": [e.stats.decode_calls for e in engines],
                            "in_use": sum(e.allocator.in_use() for e in engines)}}


PART = int(sys.argv[1])  # the script runs in two halves, one per pytest-xdist worker
reference = run(None, rollouts=PART == 0)  # the second half needs only the one-device update's params
ENGINE = ("engine_tokens", "engine_sampled", "engine_logprobs", "engine_pool")
ONE = ("loss", "grad_norm", "kl", "tokens", "sampled", "sampled_logprobs", *ENGINE)
out = {"one": {k: reference[k] for k in ONE}} if PART == 0 else {}
halves = ([((8, 1, 1), 1, False), ((2, 4, 1), 1, False), ((2, 2, 2), 1, False)],
          [((1, 2, 4), 1, False), ((2, 2, 2), 2, False), ((2, 2, 2), 2, True)])
for shape, accum, packed in halves[PART]:
    r = run(shape, accum, packed)
    leaves = jax.tree_util.tree_flatten_with_path(reference["params"])[0]
    other = jax.tree.leaves(r["params"])
    rel = {path_string(k): float(np.linalg.norm(b - a) / np.linalg.norm(a)) for (k, a), b in zip(leaves, other)}
    out[f"{shape}/{accum}" + ("/packed" if packed else "")] = {
                               "loss": r["loss"], "grad_norm": r["grad_norm"], "kl": r["kl"],
                               "tokens": r["tokens"], "param_rel_diff": rel, "specs": r["specs"],
                               "mu_specs": r["mu_specs"], "sampled": r["sampled"],
                               "sampled_logprobs": r["sampled_logprobs"], **{k: r[k] for k in ENGINE}}

if PART == 0:
    print(json.dumps(out))
    sys.exit(0)

# LoRA: adapters (replicated) over a sharded frozen base; the merged weights inside the jitted step.
from jaxrl_llm.models.lora import LoraSpec, init_adapters, merge_adapters

spec = LoraSpec(rank=4, alpha=8.0, targets="(q|k|v|o|gate|up|down)_proj")
adapters0 = init_adapters(params, spec, jax.random.key(3))
adapters0 = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape), adapters0)  # B != 0


def run_lora(shape):
    devices = jax.devices()[:1] if shape is None else jax.devices()
    mesh = make_mesh(MeshShape(1, 1, 1) if shape is None else MeshShape(*shape), devices)
    shardings = param_shardings(params, mesh)
    base = jax.device_put(jax.tree.map(jnp.copy, params), shardings)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    adapters = jax.device_put(jax.tree.map(jnp.copy, adapters0), replicated)
    optimizer, _ = make_optimizer(OptimSection(learning_rate=1e-2), 10)
    opt_state = init_optimizer_state(optimizer, adapters, jax.tree.map(lambda x: replicated, adapters), mesh)
    update = jit_one_step_update(mesh, state_sharding({"params": adapters, "opt_state": opt_state}),
                                 frozen_sharding={"base": shardings},
                                 loss_fn=policy_loss, model_config=config, loss_config=loss_config,
                                 optimizer=optimizer, grad_accum=1,
                                 compose=lambda a, f: merge_adapters(f["base"], a, spec.scale))
    state, m = update({"params": adapters, "opt_state": opt_state},
                      jax.tree.map(lambda x: global_array(x, mesh), batch), jax.random.key(0), {"base": base})
    new = state["params"]
    return float(m["loss"]), to_host(new), to_host(base)


lora_one = run_lora(None)
out["lora"] = {}
for shape in [(8, 1, 1), (2, 2, 2), (1, 2, 4)]:
    loss, new, base = run_lora(shape)
    leaves = jax.tree_util.tree_flatten_with_path(lora_one[1])[0]
    rel = {path_string(k): float(np.linalg.norm(b - a) / np.linalg.norm(a))
           for (k, a), b in zip(leaves, jax.tree.leaves(new))}
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(adapters0), jax.tree.leaves(new)))
    base_same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base)))
    out["lora"][str(shape)] = {"loss": loss, "loss_one": lora_one[0], "rel": rel, "moved": moved,
                               "base_same": base_same}

# Loading a checkpoint straight into its shards.
directory = tempfile.mkdtemp()
save_hf_model(params, config, directory)
mesh = make_mesh(MeshShape(2, 2, 2))
_, loaded = load_hf_model(directory, mesh=mesh)
expected = param_shardings(params, mesh)
load = {}
for (k, x), want, src in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(expected),
                             jax.tree.leaves(params)):
    shard_shapes = sorted({tuple(s.data.shape) for s in x.addressable_shards})
    load[path_string(k)] = {"equal": bool(np.array_equal(np.asarray(x), np.asarray(src))),
                            "spec": str(tuple(x.sharding.spec)), "want": str(tuple(want.spec)),
                            "shard_shapes": shard_shapes, "shape": list(x.shape)}
out["load"] = load
print(json.dumps(out))
"""


def _run_mesh_script(part: int) -> str:
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(8),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(part)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict:
    """The 8-device script's results, computed once per test session in two halves: with pytest-xdist, each
    worker that reaches this fixture runs a half nobody has claimed (a non-blocking file lock), then waits for
    the other half, so neither worker idles while the other compiles everything."""
    if worker_id == "master":  # no xdist
        return {**json.loads(_run_mesh_script(0)), **json.loads(_run_mesh_script(1))}
    from filelock import FileLock, Timeout

    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by the workers
    paths = [shared / f"mesh_results_{part}.json" for part in (0, 1)]
    for part, path in enumerate(paths):
        lock = FileLock(str(path) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # the other worker is computing this half
        try:
            if not path.is_file():
                path.write_text(_run_mesh_script(part))
        finally:
            lock.release()
    results: dict = {}
    for path in paths:
        with FileLock(str(path) + ".lock"):
            results.update(json.loads(path.read_text()))
    return results


@pytest.mark.parametrize("mesh", [f"{m}/1" for m in MESHES] + ["(2, 2, 2)/2", "(2, 2, 2)/2/packed"])
def test_train_step_matches_one_device(mesh_results: dict, mesh: str) -> None:
    """Loss, gradient norm, KL and every updated parameter equal one device's within 1e-5 (relative): on every
    mesh, with 2 micro-batches, and with those micro-batches packed (rl.packing)."""
    one, r = mesh_results["one"], mesh_results[mesh]
    for key in ("loss", "grad_norm", "kl"):
        np.testing.assert_allclose(r[key], one[key], rtol=1e-5, err_msg=key)
    assert one["kl"] > 0 and one["grad_norm"] > 0  # the KL term and the gradient are really there
    worst = max(r["param_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, worst


@pytest.mark.parametrize("mesh", [f"{m}/1" for m in MESHES])
def test_greedy_sampling_matches_one_device(mesh_results: dict, mesh: str) -> None:
    tokens = np.asarray(mesh_results[mesh]["tokens"])
    assert tokens.shape == (16, 24)
    np.testing.assert_array_equal(tokens, np.asarray(mesh_results["one"]["tokens"]))


@pytest.mark.parametrize("mesh", [f"{m}/1" for m in MESHES])
def test_sampled_tokens_match_one_device(mesh_results: dict, mesh: str) -> None:
    """Temperature + top-p sampling with one key draws the same tokens on every mesh (each row's uniforms do
    not depend on how rows are split), with the same log-probs."""
    one, r = mesh_results["one"], mesh_results[mesh]
    tokens = np.asarray(r["sampled"])
    np.testing.assert_array_equal(tokens, np.asarray(one["sampled"]))
    assert len({tuple(row) for row in tokens}) == len(tokens)  # sampled rows differ (n=2 share a prompt)
    np.testing.assert_allclose(r["sampled_logprobs"], one["sampled_logprobs"], atol=1e-5)


@pytest.mark.parametrize("mesh", [f"{m}/1" for m in MESHES])
def test_the_rollout_engine_on_a_mesh_gives_one_devices_tokens(mesh_results: dict, mesh: str) -> None:
    """The rollout engine on every mesh, one engine per data-parallel shard: greedy tokens equal the static
    sampler's on one device, sampled tokens (temperature + top-p) and their log-probs the engine's on one device;
    each device holds its shard's pool only (the total / data-parallel shards, / tensor where the KV heads (2)
    split over it), a shard of one device decodes with the C++ kernel, every shard decodes, and every page is back
    after the call."""
    one, r = mesh_results["one"], mesh_results[mesh]
    np.testing.assert_array_equal(np.asarray(r["engine_tokens"]), np.asarray(one["tokens"]))
    tokens = np.asarray(r["engine_sampled"])
    np.testing.assert_array_equal(tokens, np.asarray(one["engine_sampled"]))
    assert len({tuple(row) for row in tokens}) == len(tokens)
    np.testing.assert_allclose(r["engine_logprobs"], one["engine_logprobs"], atol=1e-5)
    tensor = int(mesh.split("/")[0].strip("()").split(",")[2])
    pool = r["engine_pool"]
    assert ("tensor" in pool["spec"]) == (tensor == 2), pool  # 4 does not divide 2 heads
    assert pool["shards"] == 8 // tensor and len(pool["devices"]) == 8 and pool["in_use"] == 0, pool
    split = tensor if tensor == 2 else 1
    assert pool["per_device_bytes"] == [pool["total_bytes"] // pool["shards"] // split], pool
    assert all(calls >= 1 for calls in pool["decode_calls"]), pool  # every shard's engine decoded
    from jaxrl_llm.engine import cpu_kernel

    if tensor == 1 and cpu_kernel.unavailable_reason() is None:
        assert pool["attention"] == ["cpu"], pool  # the kernel on every device
    assert one["engine_pool"]["devices"] == [0] and one["engine_pool"]["shards"] == 1


# What the rules say for this model on the (2, 2, 2) mesh (kernels are [in, out], layers stacked first).
EXPECTED_222 = {
    "embed/embedding": ("tensor", "fsdp"),
    "lm_head/kernel": ("fsdp", "tensor"),
    "final_norm/scale": (None,),
    "layers/attn/q/kernel": (None, "fsdp", "tensor"),
    "layers/attn/k/kernel": (None, "fsdp", "tensor"),
    "layers/attn/v/kernel": (None, "fsdp", "tensor"),
    "layers/attn/q/bias": (None, "tensor"),
    "layers/attn/k/bias": (None, "tensor"),
    "layers/attn/v/bias": (None, "tensor"),
    "layers/attn/o/kernel": (None, "tensor", "fsdp"),
    "layers/attn/o/bias": (None, None),
    "layers/mlp/gate/kernel": (None, "fsdp", "tensor"),
    "layers/mlp/up/kernel": (None, "fsdp", "tensor"),
    "layers/mlp/down/kernel": (None, "tensor", "fsdp"),
    "layers/attn_norm/scale": (None, None),
    "layers/mlp_norm/scale": (None, None),
}


@pytest.mark.parametrize("mesh", ["(8, 1, 1)", "(2, 2, 2)", "(1, 2, 4)"])
def test_lora_step_matches_one_device(mesh_results: dict, mesh: str) -> None:
    """A LoRA update (replicated adapters, the base sharded and frozen) is the same on any mesh."""
    r = mesh_results["lora"][mesh]
    assert r["loss"] == pytest.approx(r["loss_one"], rel=1e-5)
    assert max(r["rel"].values()) < 1e-5, r["rel"]
    assert r["moved"] > 1e-4  # the adapters did move
    assert r["base_same"]  # the frozen base is untouched


def test_every_parameter_and_adam_moment_is_sharded_as_the_rules_say(mesh_results: dict) -> None:
    r = mesh_results["(2, 2, 2)/1"]
    assert set(r["specs"]) == set(EXPECTED_222)
    for path, spec in EXPECTED_222.items():
        assert r["specs"][path] == str(spec), path
        assert r["mu_specs"][path] == str(spec), path  # Adam's moments live with their parameter


def test_checkpoint_loads_straight_into_shards(mesh_results: dict) -> None:
    load = mesh_results["load"]
    assert set(load) == set(EXPECTED_222)
    for path, info in load.items():
        assert info["equal"], path
        assert info["spec"] == info["want"] == str(EXPECTED_222[path]), path
        # Each device holds one shard: the global shape divided by the sizes of the named mesh axes.
        want = [d // (2 if axis else 1) for d, axis in zip(info["shape"], EXPECTED_222[path], strict=True)]
        assert info["shard_shapes"] == [want], path


def test_axes_that_do_not_divide_a_dimension_are_dropped() -> None:
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    assert fit_spec(P("tensor", "fsdp"), (7, 4), mesh) == P(None, "fsdp")
    assert fit_spec(P(("data", "fsdp")), (6,), mesh) == P(None)  # 6 rows do not split 4 ways
    assert fit_spec(P(("data", "fsdp")), (8, 3), mesh) == P(("data", "fsdp"), None)
    # 2 KV heads x hd 8 = 16 columns split over tensor=2; a 14-head Qwen2.5-0.5B-like o kernel keeps rows whole
    # when tensor=4 does not divide 14 * 64 = 896? It does (224 each): the rule is about divisibility only.
    assert param_spec("layers/attn/o/kernel", (24, 896, 896), mesh) == P(None, "tensor", "fsdp")
    assert param_spec("decoder/layers/mlp/down/kernel", (2, 6, 4), mesh) == P(None, "tensor", "fsdp")
    assert param_spec("value_head/kernel", (5, 1), mesh) == P(None, None)
    with pytest.raises(ValueError, match="no partition rule"):
        param_spec("layers/attn/new_thing/kernel", (2, 4, 4), make_mesh(MeshShape(1, 1, 1)))


def test_mesh_shape_resolution() -> None:
    assert MeshShape(-1, 2, 2).resolve(8) == (2, 2, 1, 2)  # (data, fsdp, expert, tensor)
    assert MeshShape(2, -1, 1).resolve(8) == (2, 4, 1, 1)
    assert MeshShape(1, 1, 1, expert=-1).resolve(8) == (1, 1, 8, 1)
    assert MeshShape(2, 1, 2, expert=2).resolve(8) == (2, 1, 2, 2)
    with pytest.raises(ValueError, match="available"):
        MeshShape(2, 2, 1).resolve(8)
    with pytest.raises(ValueError, match="not divisible"):
        MeshShape(-1, 3, 1).resolve(8)
    with pytest.raises(ValueError, match="at most one is -1"):
        MeshShape(-1, -1, 1).resolve(8)
    # The sequence axis: resolve leaves it out (what rules and row specs see), sizes has every axis of the mesh.
    assert MeshShape(-1, 1, 1, sequence=4).resolve(8) == (2, 1, 1, 1)
    assert MeshShape(-1, 1, 1, sequence=4).sizes(8) == (2, 1, 1, 4, 1)  # (data, fsdp, expert, sequence, tensor)
    assert MeshShape(1, 1, 2, sequence=-1).sizes(8) == (1, 1, 1, 4, 2)
    with pytest.raises(ValueError, match="sequence"):
        MeshShape(1, 1, 1, sequence=3).resolve(8)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_config(task: Path, out: Path) -> str:
    return (
        f"model: {{path: {task / 'model'}}}\n"
        f"data: {{train: {task / 'train.jsonl'}, eval: {task / 'test.jsonl'}, max_prompt_tokens: 16}}\n"
        f"out_dir: {out}\nsteps: 2\nseed: 3\neval_size: 4\neval_batch_size: 4\nprogress_bar: false\n"
        "tensorboard: false\ncheckpoint_every: 2\nsample_every: 0\n"
        "sampling: {max_new_tokens: 6, temperature: 1.0}\n"
        "rl: {prompts_per_step: 4, group_size: 4, beta: 0.04, mu: 2, minibatch_size: 8}\n"
        "optim: {learning_rate: 1.0e-3}\n"
        "rewards: [{name: 'multihost_reward:starts_with_digit'}]\n"
    )


def test_two_processes_train_like_one(tiny_task: Path, tmp_path: Path) -> None:
    """`python train.py` as 2 processes x 2 CPU devices (jax.distributed, gloo) runs the same 2 GRPO steps
    as 1 process x 4 devices: same rewards, losses and gradient norms; each process scored half the rows;
    process 0 alone wrote the metrics and the exported model."""
    base = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT / "tests")}
    single, multi = tmp_path / "single", tmp_path / "multi"
    for out in (single, multi):
        out.mkdir()
        (out / "run.yaml").write_text(_run_config(tiny_task, out / "run"))
    cmd = [sys.executable, str(ROOT / "train.py"), "--algo", "grpo", "--config"]
    ref = subprocess.run(cmd + [str(single / "run.yaml")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**base, "XLA_FLAGS": virtual_devices_xla_flags(4),
                              "REWARD_LOG": str(single / "rewards.log")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    port = _free_port()
    procs = [
        subprocess.Popen(
            cmd + [str(multi / "run.yaml"), "distributed.enabled=true",
                   f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
                   f"distributed.process_id={i}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, "XLA_FLAGS": virtual_devices_xla_flags(2),
                 "REWARD_LOG": str(multi / "rewards.log")},
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]

    def steps(out: Path) -> list[dict]:
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if "reward/mean" in r]

    ref_rows, multi_rows = steps(single), steps(multi)
    assert [r["step"] for r in multi_rows] == [1, 2]  # written once (by process 0), not twice
    assert any(r["reward/std"] > 0 for r in ref_rows)  # the reward varies, so the update is not trivial
    for a, b in zip(ref_rows, multi_rows, strict=True):
        for key in ("reward/mean", "reward/std", "loss", "grad_norm", "kl", "completion_length/mean"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-7, err_msg=key)
    # Rollouts of 16 rows: one process scores all 16; two processes 8 each, for every rollout. (The 4-row
    # calls are the held-out evaluations before and after, which every process runs whole.)
    single_log = (single / "rewards.log").read_text().split()
    multi_log = sorted(tuple(line.split()) for line in (multi / "rewards.log").read_text().splitlines())
    assert single_log[1::2] == ["4", "16", "16", "4"]
    assert multi_log == sorted([("0", "4"), ("1", "4")] * 2 + [("0", "8"), ("1", "8")] * 2)
    assert (multi / "run" / "hf" / "config.json").is_file()
    assert (multi / "run" / "checkpoints").is_dir()


def test_batch_not_divisible_by_the_mesh_is_a_clear_error(tiny_task: Path, tmp_path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": virtual_devices_xla_flags(4)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--algo", "sft", f"model.path={tiny_task / 'model'}",
         f"data.train={tiny_task / 'train.jsonl'}", "data.eval=''", f"out_dir={tmp_path}", "steps=1",
         "sft.batch_size=6", "progress_bar=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sft.batch_size=6 must be divisible by mesh.data * mesh.fsdp * mesh.expert (4)" in proc.stderr
