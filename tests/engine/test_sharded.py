"""The rollout engine on a mesh of 8 virtual CPU devices, one engine per data-parallel shard (`engine/sharded.py`):
requests dealt whole and balanced by tokens, a kept conversation's next turn on the shard that holds its pages (the
same tokens as one device's engine, turn after turn), each shard's pool its own, and the pages back when released.
The sampler's tokens, log-probs and pool placement on four meshes: tests/test_sharding.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.runs import ROOT
from tests.xla_settings import virtual_devices_xla_flags

pytestmark = pytest.mark.heavy(seconds=38)


_SCRIPT = r"""
import json
import jax
import numpy as np
from jaxrl_llm.engine import Engine, Request, ShardedEngine
from jaxrl_llm.engine.sharded import shard_meshes
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.sharding import make_mesh, param_shardings

config = config_from_hf({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                         "vocab_size": 61})
params = init_params(config, jax.random.key(3))
rng = np.random.default_rng(0)
prompts = [rng.integers(1, 61, n).tolist() for n in (30, 3, 17, 5, 9, 2)]
greedy = SamplingConfig(max_new_tokens=6, greedy=True, n=2)
one_turn = SamplingConfig(max_new_tokens=5, greedy=True)


def turns(engine, placed):
    # turn 1: every prompt, n=2, kept; turn 2: each conversation's first sample continues with a reply of 3 tokens
    first = engine.generate(placed, [Request(p, np.asarray([0, i], np.uint32), n=2) for i, p in enumerate(prompts)],
                            greedy, keep=True)
    shards = [[getattr(c.conversation, "shard", 0) for c in group] for group in first]
    follow = [Request([7, 8, 9], np.asarray([1, i], np.uint32), conversation=group[0].conversation)
              for i, group in enumerate(first)]
    second = engine.generate(placed, follow, one_turn, keep=True)
    in_use = [e.allocator.in_use() for e in getattr(engine, "engines", [engine])]
    for group in first:
        engine.release(group[1].conversation)
    for group in second:
        engine.release(group[0].conversation)
    after = [e.allocator.in_use() for e in getattr(engine, "engines", [engine])]
    tokens = [[c.tokens for c in g] for g in first] + [[c.tokens for c in g] for g in second]
    return {"tokens": tokens, "shards": shards, "second_shards": [getattr(g[0].conversation, "shard", 0)
                                                                  for g in second],
            "in_use": in_use, "after": after}


out = {"one": turns(Engine(config, num_pages=64, page_size=8, slots=12), params)}
mesh = make_mesh((8, 1, 1))
engine = ShardedEngine(config, num_pages=128, page_size=8, slots=12, mesh=mesh)
result = turns(engine, jax.device_put(params, param_shardings(params, mesh)))
loads = [0] * 8
for r in engine.deal([Request(p, np.zeros(2, np.uint32), n=2) for p in prompts], greedy):
    loads[r] += 1
result |= {"shards_of_mesh": [len(m.devices.flat) for m in shard_meshes(make_mesh((2, 2, 2)))],
           "pools": [e.num_pages for e in engine.engines], "attention": sorted({e.attention for e in engine.engines}),
           "dealt": engine.deal([Request(p, np.zeros(2, np.uint32), n=2) for p in prompts], greedy),
           "dealt_long_first": engine.deal([Request([1] * n, np.zeros(2, np.uint32)) for n in [100] + [1] * 9],
                                           one_turn)}
out["mesh"] = result

# (4, 1, 2): four engines of two tensor devices each, through the sampler a run uses
from jaxrl_llm.engine import PagedSampler
from jaxrl_llm.sampling import SamplingConfig

rows = np.zeros((4, 12), np.int32)
mask = np.zeros((4, 12), np.int32)
for i, n in enumerate((12, 4, 7, 1)):
    rows[i, 12 - n:] = rng.integers(1, 61, n)
    mask[i, 12 - n:] = 1
drawn = SamplingConfig(max_new_tokens=5, temperature=1.0, n=2)
ref = PagedSampler(config, page_size=8)(params, rows, mask, jax.random.key(9), drawn)
mesh412 = make_mesh((4, 1, 2))
sampler = PagedSampler(config, page_size=8)
got = sampler(jax.device_put(params, param_shardings(params, mesh412)), rows, mask, jax.random.key(9), drawn)
held = {}
for e in sampler.engine.engines:
    for layer in e.pages:
        for pool in layer.values():
            for piece in pool.addressable_shards:
                held[piece.device.id] = held.get(piece.device.id, 0) + piece.data.nbytes
total = sum(pool.nbytes for e in sampler.engine.engines for layer in e.pages for pool in layer.values())
out["412"] = {"same_tokens": np.asarray(got.tokens).tolist() == np.asarray(ref.tokens).tolist(),
              "logprob_diff": float(np.abs(np.asarray(got.logprobs) - np.asarray(ref.logprobs)).max()),
              "held": sorted(set(held.values())), "devices": len(held), "total": total,
              "engines": len(sampler.engine.engines),
              "decode_calls": [e.stats.decode_calls for e in sampler.engine.engines]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(8),
           "JAX_PLATFORMS": "cpu"}
    for _ in range(2):  # a process killed by a signal (XLA:CPU's rare crash, docs/testing.md) runs once more
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
        if proc.returncode >= 0:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_conversations_continue_on_their_shard_with_one_devices_tokens(results: dict) -> None:
    one, mesh = results["one"], results["mesh"]
    assert mesh["tokens"] == one["tokens"]  # both turns, every sample
    assert all(len(set(group)) == 1 for group in mesh["shards"])  # a request's samples never straddle shards
    assert mesh["second_shards"] == [group[0] for group in mesh["shards"]]  # a turn goes where its pages are
    assert len({group[0] for group in mesh["shards"]}) == len(mesh["shards"])  # 6 requests on 6 of the 8 shards
    assert sum(mesh["in_use"]) > 0 and mesh["after"] == [0] * 8  # released: every page back in every pool


def test_four_engines_of_two_tensor_devices_sample_one_devices_tokens(results: dict) -> None:
    """(4, 1, 2): four engines, each on its pair of tensor devices (its KV heads split over them): sampled tokens and
    log-probs of one device's engine; each device holds an eighth of the pool; every engine decodes."""
    r = results["412"]
    assert r["same_tokens"] and r["logprob_diff"] <= 1e-5, r
    assert r["engines"] == 4 and r["devices"] == 8 and r["held"] == [r["total"] // 8], r
    assert all(calls >= 1 for calls in r["decode_calls"]), r


def test_requests_are_dealt_by_tokens_and_the_pool_is_split(results: dict) -> None:
    mesh = results["mesh"]
    # six requests on eight shards: one each
    assert mesh["dealt"] == [0, 1, 2, 3, 4, 5]
    # by tokens, not by count: after a 100-token prompt on shard 0 the 1-token ones fill the others, twice over
    assert mesh["dealt_long_first"] == [0, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert mesh["pools"] == [16] * 8  # 128 pages in all, 16 a shard
    assert mesh["shards_of_mesh"] == [2, 2, 2, 2]  # (2, 2, 2): a shard per (data, fsdp) position, its tensor pair
    from jaxrl_llm.engine import cpu_kernel

    if cpu_kernel.unavailable_reason() is None:
        assert mesh["attention"] == ["cpu"]  # one device a shard: the C++ kernel on each


_TWO_PROCESSES = r"""
import json
import sys

import jax
import numpy as np

process = int(sys.argv[1])
jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[2]}", num_processes=2, process_id=process)
from jax.sharding import NamedSharding

from jaxrl_llm.engine import PagedSampler, ShardedEngine
from jaxrl_llm.models.decoder import init_params
from jaxrl_llm.models.hf import config_from_hf
from jaxrl_llm.sampling import SamplingConfig
from jaxrl_llm.sharding import make_mesh, param_specs

config = config_from_hf({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                         "vocab_size": 61})
host = jax.device_get(init_params(config, jax.random.key(3)))
mode = sys.argv[3]
mesh = make_mesh((4, 1, 1) if mode == "data" else (2, 2, 1))  # (2, 2, 1): fsdp splits the weights over processes
specs = param_specs(host, mesh)
params = jax.tree.map(lambda x, spec: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                                                  lambda index: x[index]), host, specs)
rng = np.random.default_rng(0)
lengths = [7, 3, 12, 5, 9, 1]
tokens = np.zeros((6, 12), np.int32)
mask = np.zeros((6, 12), np.int32)
for i, n in enumerate(lengths):
    tokens[i, 12 - n:] = rng.integers(1, 61, n)
    mask[i, 12 - n:] = 1
sampler = PagedSampler(config, page_size=8)
out = sampler(params, tokens, mask, jax.random.key(5), SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
engine = sampler.engine
print(json.dumps({"tokens": np.asarray(out.tokens).tolist(), "logprobs": np.asarray(out.logprobs).tolist(),
                  "sharded": isinstance(engine, ShardedEngine), "local": sum(e is not None for e in engine.engines),
                  "decode_calls": engine.stats.decode_calls}))
"""


@pytest.mark.parametrize("mode", ["data", "fsdp"])
def test_two_processes_each_sample_their_share_with_one_devices_tokens(mode: str) -> None:
    """2 processes x 2 CPU devices (jax.distributed): one engine per device, each process running its own two; the
    weights replicated over data, or split over processes by fsdp; every process ends with every completion, the
    sampled tokens and log-probs of one device's engine."""
    import socket

    from jaxrl_llm.engine import PagedSampler
    from jaxrl_llm.models.decoder import init_params
    from jaxrl_llm.models.hf import config_from_hf
    from jaxrl_llm.sampling import SamplingConfig

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": virtual_devices_xla_flags(2),
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(i), str(port), mode], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(g["sharded"] and g["local"] == 2 and g["decode_calls"] >= 1 for g in got), got
    assert got[0]["tokens"] == got[1]["tokens"] and got[0]["logprobs"] == got[1]["logprobs"]

    import jax
    import numpy as np

    config = config_from_hf({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "vocab_size": 61})
    params = init_params(config, jax.random.key(3))
    rng = np.random.default_rng(0)
    tokens, mask = np.zeros((6, 12), np.int32), np.zeros((6, 12), np.int32)
    for i, n in enumerate([7, 3, 12, 5, 9, 1]):
        tokens[i, 12 - n:] = rng.integers(1, 61, n)
        mask[i, 12 - n:] = 1
    one = PagedSampler(config, page_size=8)(params, tokens, mask, jax.random.key(5),
                                            SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
    assert got[0]["tokens"] == np.asarray(one.tokens).tolist()
    np.testing.assert_allclose(got[0]["logprobs"], np.asarray(one.logprobs), atol=1e-5)
