"""Per-device memory planner: will this model, mesh and batch fit before anything is allocated or compiled?

    python -m jaxrl_llm plan --model Qwen/Qwen2.5-0.5B --mesh data=1,fsdp=8,tensor=1 --batch 8 --group-size 8 \\
        --prompt-len 256 --new-tokens 512 --dtype bfloat16 --remat --device-memory 80GiB

Only `config.json` is read (a local model directory, a path to the file itself, or a hub id, for which only
that file is downloaded). Shapes come from `models.decoder.param_shapes` (`jax.eval_shape`: nothing is
allocated) and placements from the partition rules of `jaxrl_llm.sharding`, evaluated on a
`jax.sharding.AbstractMesh` of the requested axis sizes, so a `data=2,fsdp=16,tensor=8` plan runs on a laptop.

Per-device bytes (`s` = itemsize of the compute dtype, `p` = of the parameter dtype; "shard" = the
elements one device holds under the spec the rules give that array, see `shard_shape`):

- params: the float32 master weights, `sum over parameters of shard(x) * 4` (the trainers keep a float32 master
  whatever `param_dtype` is, and compute with a `param_dtype` working copy); reference params (`--reference`,
  a KL term): `sum of shard(x) * p` (a frozen copy of the starting policy in `param_dtype`, placed like the
  policy).
- optimizer state: the optimizer's state tree over the float32 master (`jax.eval_shape(optimizer.init, ...)`),
  every copy of the parameter tree sharded like the parameters, counters replicated. AdamW: `2 * params` (mu
  and nu, float32) + 17 bytes of counters.
- gradients: the train step's float32 accumulator, `sum over parameters of shard(x) * 4`.
- KV cache (sampler): `[L, B*n, S, KVH, hd]` keys and values split over `("data", "fsdp")` on the batch and
  `tensor` on the KV heads (each only when it divides): `2 * L * (B*n / (data*fsdp)) * S * (KVH / tensor) *
  hd * s`, `S = round_up(prompt_len, prompt_bucket) + round_up(new_tokens, new_tokens_bucket)`.
- sampler weight copy: the decode loop's per-layer `StepWeights` (q|k|v and gate|up concatenated, cast to the
  compute dtype, gathered over `fsdp`, split over `tensor`), made once per sampler call: see
  `sampler_weight_bytes`.
- activations of the train step: an order-of-magnitude estimate, see `activation_bytes`.

The sampler and the train step are separate XLA programs, so their buffers are never live together:

    peak = params + reference + optimizer + max(KV cache + sampler copy, gradients + activations)

Sampling beside training (`rollout.max_staleness` K > 0, docs/overlap.md) runs both at once and keeps up to K + 1
copies of the inference weights (`param_dtype`, placed like the reference) for the sampler. On one mesh:

    peak = params + reference + optimizer + (K + 1) weight copies + KV cache + sampler copy + gradients + activations

With the sampler on devices of its own (`rollout.sampler_devices`), the trainer's devices hold no rollout
(`persistent + update`) and each sampler device holds `(K + 1)` weight copies + its KV cache + its sampler copy,
under the sampler mesh's `(data, 1, tensor)` placement; both must fit.

Not counted: the runtime's own reservation (CUDA context, and on GPUs JAX preallocates 75% of the memory
unless `XLA_PYTHON_CLIENT_MEM_FRACTION` / `XLA_PYTHON_CLIENT_PREALLOCATE` say otherwise: pass the usable
amount as `--device-memory`), the reference model's log-prob pass (a forward only, smaller than the train
step), the prefill's transient `[B, P_b]` cache, rollout arrays, and fragmentation: keep some margin.

`mesh.sequence = N` (context parallelism) splits the update's positions over `N` more devices: parameters, optimizer
state, KV cache and batch as on the `(data, fsdp, expert, tensor)` mesh, the activations' per-position terms `1/N`
(`activation_bytes`). `longest_context` bisects for the longest context whose step fits a device's memory.

`plan_memory` is the pure function; `python -m jaxrl_llm plan` (`jaxrl_llm/cli/plan.py`) is a thin shell around
it that reads a config and prints a table. The optimizer planned is the trainer's own (`make_optimizer`: AdamW with
clipping and the non-finite guard), or any optax transformation passed in.
"""

from jaxrl_llm.memory_plan.parts import (
    HEAD_BLOCKS,
    activation_bytes,
    active_width,
    optimizer_state_bytes,
    packed_weight_bytes,
    sampler_weight_bytes,
    stored_width,
    trainer_optimizer,
)
from jaxrl_llm.memory_plan.plan import DEFAULT_MODEL, TRAINER_BUCKET, MemoryPlan, longest_context, plan_memory
from jaxrl_llm.memory_plan.shards import (
    KV_CACHE_SPEC,
    P,
    abstract_mesh,
    axis_sizes_of,
    fit_spec_sizes,
    mesh_tuple,
    param_partition_specs,
    shard_shape,
    tree_shard_bytes,
)

__all__ = [
    "DEFAULT_MODEL", "HEAD_BLOCKS", "KV_CACHE_SPEC", "P", "TRAINER_BUCKET", "MemoryPlan", "abstract_mesh",
    "activation_bytes", "active_width", "axis_sizes_of", "fit_spec_sizes", "longest_context", "mesh_tuple",
    "optimizer_state_bytes",
    "packed_weight_bytes", "param_partition_specs", "plan_memory", "sampler_weight_bytes", "shard_shape",
    "stored_width", "trainer_optimizer", "tree_shard_bytes",
]
