"""Expert parallelism on 8 virtual CPU devices: a mixture of experts on meshes with an `expert` axis, `(data, fsdp,
expert, tensor)` = (1,1,8,1), (2,1,4,1), (1,2,2,2), gives one device's log-probs, loss and gradient of every weight
(router, experts, shared expert) under routing replay; each device holds `E / expert` experts; one layer's
`moe.experts_parallel` equals the dense reference and gathers / scatters over the expert axis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.runs import ROOT
from tests.xla_settings import virtual_devices_xla_flags

pytestmark = pytest.mark.heavy(seconds=52)

MESHES = ("(1, 1, 8, 1)", "(2, 1, 4, 1)", "(1, 2, 2, 2)")  # (data, fsdp, expert, tensor)

_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.models import moe
from jaxrl_llm.sharding import (expert_mesh, global_array, make_mesh,
                                param_shardings, path_string, to_host)
from jaxrl_llm.trainers.objectives import PolicyBatch, PolicyObjective, completion_logprobs, policy_loss
from jaxrl_llm.rl import PolicyLossOptions
from tests.batches import random_rollout

assert jax.device_count() == 8, jax.devices()
hf = {"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 32,
      "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "num_experts": 8,
      "num_experts_per_tok": 2, "norm_topk_prob": False}
config = config_from_hf(hf)
params = init_params(config, jax.random.key(1))
# Routers sharpened (top-k without near-ties, so float reassociation on a mesh cannot flip a choice).
params = jax.tree_util.tree_map_with_path(
    lambda p, x: x * 30.0 if "router" in path_string(p) else x, params)
rng = np.random.default_rng(0)
n, p_len, t_len = 16, 6, 8
pt, pm, ct, cm, logp = random_rollout(params, config, rng, n, p_len, t_len)
old = (logp + rng.normal(0, 0.1, logp.shape)).astype(np.float32) * cm
adv = rng.normal(0, 1, n).astype(np.float32)
# A recorded selection to replay: k distinct experts per token and layer, some tokens without a record.
recorded = np.argsort(rng.random((n, p_len + t_len, config.num_layers, config.num_experts)), -1)[..., :2]
recorded[rng.random((n, p_len + t_len)) < 0.2] = moe.NO_RECORD
from jaxrl_llm.models.sequences import Sequences
batch = PolicyBatch(Sequences(pt, pm, ct, cm), old, old, adv, routing=recorded.astype(np.int16))
loss_config = PolicyObjective(options=PolicyLossOptions(epsilon_low=0.1, epsilon_high=0.1, aggregation="token-mean"),
                              beta=0.0, router_aux_loss_coef=0.01, routing_replay=True)


def run(shape):
    devices = jax.devices()[:1] if shape is None else jax.devices()
    mesh = make_mesh((1, 1, 1) if shape is None else shape, devices)
    cfg = config.replace(expert_mesh=expert_mesh(mesh))
    shardings = param_shardings(params, mesh)
    placed = jax.device_put(jax.tree.map(jnp.copy, params), shardings)
    logprob_fn = jax.jit(lambda p, *b: completion_logprobs(p, cfg, Sequences(*b))[0])
    rows = lambda x: global_array(x, mesh)
    lp = to_host(logprob_fn(placed, rows(pt), rows(pm), rows(ct), rows(cm)))
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: policy_loss(p, b, model_config=cfg, loss_config=loss_config,
                                                                  num_tokens=jnp.sum(b.sequences.completion_mask),
                                                                  num_seqs=jnp.asarray(n))[0]))
    loss, grads = to_host(grad_fn(placed, jax.tree.map(rows, batch)))
    shard_shapes = {path_string(k): sorted({tuple(s.data.shape) for s in v.addressable_shards})
                    for k, v in jax.tree_util.tree_flatten_with_path(placed)[0] if "experts" in path_string(k)}
    return {"loss": float(loss), "logprobs": lp, "shard_shapes": shard_shapes, "grads": grads}

one = run(None)
out = {"one": {"loss": one["loss"]}}
for shape in [(1, 1, 8, 1), (2, 1, 4, 1), (1, 2, 2, 2)]:
    r = run(shape)
    out[str(shape)] = {"loss": r["loss"], "logprob_diff": float(np.abs(r["logprobs"] - one["logprobs"]).max()),
                       "shard_shapes": r["shard_shapes"],
                       "grad_rel": {path_string(k): float(np.linalg.norm(b - a) / np.linalg.norm(a))
                                    for (k, a), b in zip(jax.tree_util.tree_flatten_with_path(one["grads"])[0],
                                                         jax.tree.leaves(r["grads"]))}}
# One layer's experts: split over the expert axis = the dense reference on one device; the program gathers the
# group's tokens and scatters the summed shares (collectives over the expert axis only).
x = rng.normal(size=(64, 32)).astype(np.float32)
logits = rng.normal(size=(64, 8)).astype(np.float32) * 3
ids, weights = moe.route(jnp.asarray(logits), 2, renormalize=True)
layer = jax.tree.map(lambda a: 10 * a[0], params["layers"]["mlp"]["experts"])  # outputs of order 1
w = moe.Experts(layer["gate"]["kernel"], layer["up"]["kernel"], layer["down"]["kernel"])
valid = rng.random(64) < 0.9
dense = np.asarray(moe.experts_dense(x, ids, weights, w, valid=valid))
mesh = make_mesh((2, 1, 4, 1))
placed_w = jax.device_put(w, moe.Experts(*[NamedSharding(mesh, P("expert"))] * 3))
fn = jax.jit(lambda *a, valid: moe.experts_parallel(*a, mesh=mesh, valid=valid))
args = (global_array(x, mesh), global_array(np.asarray(ids), mesh), global_array(np.asarray(weights), mesh),
        placed_w, global_array(valid, mesh))
hlo = fn.lower(args[0], args[1], args[2], args[3], valid=args[4]).compile().as_text()
out["layer"] = {"diff": float(np.abs(to_host(fn(*args[:4], valid=args[4])) - dense).max()),
                "scale": float(np.abs(dense).max()), "all_gather": "all-gather" in hlo,
                "scatter": "reduce-scatter" in hlo or "all-reduce" in hlo}
# gpt-oss's experts: biases sliced with their experts, the clamped SwiGLU (limit 0.5 bites on these activations)
biases = [rng.normal(size=(8, m.shape[-1])).astype(np.float32) for m in w[:3]]
wb = moe.Experts(*w[:3], *map(jnp.asarray, biases))
clamp = (1.702, 0.5)
dense_b = np.asarray(moe.experts_dense(x, ids, weights, wb, clamp=clamp, valid=valid))
fn_b = jax.jit(lambda *a, valid: moe.experts_parallel(*a, mesh=mesh, clamp=clamp, valid=valid))
placed_wb = jax.device_put(wb, moe.Experts(*[NamedSharding(mesh, P("expert"))] * 6))
out["layer_biased"] = {"diff": float(np.abs(to_host(fn_b(*args[:3], placed_wb, valid=args[4])) - dense_b).max()),
                       "scale": float(np.abs(dense_b).max()),
                       "unclamped": float(np.abs(np.asarray(moe.experts_dense(x, ids, weights, wb, valid=valid))
                                                 - dense_b).max())}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(8),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MESHES)
def test_an_expert_axis_gives_one_devices_logprobs_loss_and_gradients(results: dict, mesh: str) -> None:
    """Live routing (the log-probs) and replayed routing with tokens that have no record (the loss and its
    gradient, the load-balancing term included): every gradient within 1e-5 of one device's, relative."""
    one, r = results["one"], results[mesh]
    assert r["logprob_diff"] <= 1e-5
    np.testing.assert_allclose(r["loss"], one["loss"], rtol=1e-6)
    worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-5, worst
    assert {"layers/mlp/router/kernel", "layers/mlp/experts/gate/kernel", "layers/mlp/shared/up/kernel"} <= set(
        r["grad_rel"])


@pytest.mark.parametrize("mesh", MESHES)
def test_each_device_holds_its_share_of_the_experts(results: dict, mesh: str) -> None:
    """Expert weights `[L, E, D, I]` split over the expert axis (and over fsdp / tensor where the mesh has them)."""
    data, fsdp, expert, tensor = eval(mesh)  # noqa: S307  (our own parameter string)
    shapes = results[mesh]["shard_shapes"]
    assert shapes["layers/mlp/experts/gate/kernel"] == [[2, 8 // expert, 32 // fsdp, 24 // tensor]]
    assert shapes["layers/mlp/experts/down/kernel"] == [[2, 8 // expert, 24 // tensor, 32 // fsdp]]


def test_one_layer_split_over_experts_equals_the_dense_reference(results: dict) -> None:
    """`experts_parallel` on a (2, 1, 1, 4) mesh, padding tokens included, = `experts_dense` on one device; its
    program gathers the expert group's tokens and sums the shares back."""
    layer = results["layer"]
    assert layer["scale"] > 0.1
    assert layer["diff"] <= 1e-5 * layer["scale"]
    assert layer["all_gather"] and layer["scatter"]
    biased = results["layer_biased"]  # gpt-oss's experts: each device's biases are its own experts'
    assert biased["scale"] > 0.1 and biased["unclamped"] > 0.1 * biased["scale"]
    assert biased["diff"] <= 1e-5 * biased["scale"]


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_line(tmp_path: Path) -> None:
    """`mesh.expert=3` for the committed 8-expert model on 3 devices: one line naming the key and the model, exit 2."""
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(3),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--algo", "grpo", "--config",
                           str(ROOT / "configs" / "grpo_arithmetic_moe.yaml"), "mesh.expert=3", "mesh.data=1",
                           "steps=1", "rl.prompts_per_step=12", f"out_dir={tmp_path / 'run'}"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mesh.expert=3 does not divide" in lines[0] and "8 experts" in lines[0], lines
