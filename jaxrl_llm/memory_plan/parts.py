"""The bytes of each part of an RL step on one device: the optimizer's state, the train step's activations, the
sampler's per-call weight copies (formulas in `jaxrl_llm.memory_plan`'s docstring and each function's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

from jaxrl_llm import sharding
from jaxrl_llm.config import OptimSection
from jaxrl_llm.memory_plan.shards import abstract_mesh, divided, tree_shard_bytes
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.optim import make_optimizer
from jaxrl_llm.rl.logprobs import logprob_chunk_size

# Float32 `[rows, chunk, V]` blocks live at once in the log-prob head (measured on XLA:CPU, see activation_bytes).
HEAD_BLOCKS = 3


def trainer_optimizer() -> optax.GradientTransformation:
    """The optimizer the trainers build (`optim.make_optimizer`: global-norm clipping, AdamW, the
    non-finite guard); its state's shapes do not depend on the schedule or the learning rate."""
    return make_optimizer(OptimSection(), total_updates=1)[0]


def optimizer_state_bytes(
    optimizer: optax.GradientTransformation, shapes: Any, axis_sizes: Mapping[str, int]
) -> int:
    """One device's bytes of `optimizer.init(params)`: the state's shapes by `jax.eval_shape`, placed by
    `sharding.optimizer_state_shardings` (parameter copies like the parameters, counters replicated).
    AdamW: `2 * sum(shard(x) * p) + 17`."""
    mesh = abstract_mesh(axis_sizes)
    state = jax.eval_shape(optimizer.init, shapes)
    shardings = sharding.optimizer_state_shardings(optimizer, state, sharding.param_shardings(shapes, mesh), mesh)
    specs = jax.tree.map(lambda s: s.spec, shardings)
    return tree_shard_bytes(state, specs, axis_sizes)


def activation_bytes(config: ModelConfig, rows: int, seq_len: int, completion_len: int, axis_sizes: Mapping[str, int],
                     *, remat: bool, logprob_block_mib: float = 256.0, sequence: int = 1) -> int:
    """Estimate of one device's activation memory in the train step (forward residuals + backward transients).

    `rows` = sequences of one micro-batch on this device, `seq_len` = `T` the forward length
    (prompt + completion - 1), `completion_len` = `C` the positions that are unembedded. With `s` the
    compute itemsize, heads `h = H/t`, KV heads `k = KVH/t`, intermediate `i = I/t`, vocabulary `v = V/t`
    (each divided by the tensor size `t` only when it divides), `b = rows`, and with a `sequence` axis of `N`
    devices (context parallelism) each device's positions `T' = ceil(T / N)` and `C' = ceil(C / N)`:

        per_layer = b*T'*(s*(5*D + 2*(h + k)*hd + 6*i) + 4*4*D) + b*h*q*T*(4 + s) + [N > 1] 2*b*T*k*hd*s
            (residuals kept for the backward: residual stream, norm outputs and their float32 internals,
            q/k/v/attention output, gate/up/silu/product; float32 softmax probabilities and their
            compute-dtype copy over `q = min(T', attention_query_chunk)` queries at a time against all `T` keys;
            on a sequence axis the all-gathered keys and values; the coefficients 5, 6 and 4*4 were measured on
            XLA:CPU, see below)
        head      = HEAD_BLOCKS*4*b*c*v + b*T'*D*4 + b*q*T
            (the log-probs come from the final hidden states `c` positions at a time, `c` =
            `train_step.logprob_chunk_size(b, C', V, logprob_block_mib)`: HEAD_BLOCKS float32 `[b, c, v]`
            blocks live at once (logits, probabilities, their cotangent); no compute-dtype copy of the output
            matrix lives across the step (the precision policy's dots keep their operands as given and cast
            them again in the backward); a tied embedding is multiplied as stored, so its gradient is the
            embedding's own, no separate `[D, v]` one; final norm; one query chunk's boolean mask: attention
            builds it per chunk from the segment ids, `models/attention.py`)
        gathered  = 2 * (per-layer weights with heads and intermediate divided by t) * s   when fsdp > 1
            (all-gathered weights of the layer in use and the next one)

        no remat: (L + 1) * per_layer + head + gathered
            (every layer's residuals, plus about one layer's worth of cotangents in the backward)
        remat:    L * s*b*T'*D + per_layer + head + gathered
            (each layer keeps only its input; one layer's activations are rebuilt at a time)

    Every term is linear in `T` for a fixed query chunk: the longest context that fits (`longest_context`) grows
    with the device memory, and `N` sequence devices hold about `1/N` of the per-position terms each.

    Calibrated against XLA's temp allocation of the real train step (`compile().memory_analysis()`) on one
    CPU device in float32: `gradients + activation_bytes` was 0.84-1.13x of it over the shapes tried (the test
    suite asserts 1.2x on one). Not calibrated: bfloat16 (XLA:CPU upcasts it; there the estimate came out
    1.2-1.6x low), the `gathered` term, and other backends, which fuse, rematerialise and reuse buffers in
    their own way: treat the number as an order-of-magnitude estimate.
    """
    t = axis_sizes["tensor"]
    b, tt, s = rows, seq_len, config.jnp_dtype.itemsize
    local, cc = -(-seq_len // sequence), -(-completion_len // sequence)  # this device's positions
    d, hd = config.hidden_size, config.head_dim
    h = divided(config.num_heads, t)
    k = divided(config.num_kv_heads, t)
    i = divided(active_width(config), t)
    v = divided(config.vocab_size, t)
    q = min(local, config.attention_query_chunk or local)
    per_layer = b * local * (s * (5 * d + 2 * (h + k) * hd + 6 * i) + 4 * 4 * d) + b * h * q * tt * (4 + s)
    per_layer += b * local * 4 * 2 * config.num_experts  # MoE: the router's float32 logits and probabilities
    if sequence > 1:  # every position's keys and values, gathered from the sequence axis
        per_layer += 2 * b * tt * k * hd * s

    chunk = logprob_chunk_size(b, cc, config.vocab_size, logprob_block_mib)
    head = HEAD_BLOCKS * 4 * b * chunk * v + b * local * d * 4 + b * q * tt
    gathered = 0
    if axis_sizes["fsdp"] > 1:
        layer_weights = d * (h + 2 * k) * hd + h * hd * d + 3 * d * divided(stored_width(config), t)
        gathered = 2 * layer_weights * config.jnp_dtype.itemsize
    if remat:
        return config.num_layers * s * b * local * d + per_layer + head + gathered
    return (config.num_layers + 1) * per_layer + head + gathered


def active_width(config: ModelConfig) -> int:
    """The feed-forward's intermediate columns each token computes: the dense MLP's, or for a mixture of experts
    `k` experts' plus the shared expert's."""
    if not config.is_moe:
        return config.intermediate_size
    return config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size


def stored_width(config: ModelConfig) -> int:
    """The feed-forward's intermediate columns stored per layer: the dense MLP's, or every expert's plus the shared
    expert's (each column a gate, an up and a down vector)."""
    if not config.is_moe:
        return config.intermediate_size
    return config.num_experts * config.moe_intermediate_size + config.shared_expert_intermediate_size


def sampler_weight_bytes(config: ModelConfig, axis_sizes: Mapping[str, int]) -> int:
    """One device's bytes of the decode loop's per-layer `StepWeights` (`models.step_weights.step_weights`), made
    once per sampler call in the compute dtype, gathered over `fsdp` and split over `tensor` (columns of q|k|v and
    gate|up, rows of o and down, each only when `t` divides them):

        L * s * (D*(H + 2*KVH)*hd / t + (H*hd / t)*D + D*2*I / t + (I / t)*D + biases)

    q|k|v and gate|up are concatenations, hence always new buffers; o and down are only copied when the
    compute dtype differs from the parameter dtype or `fsdp > 1` (a cast or a gather), else they are the
    parameter shards themselves and count 0 here.
    """
    t, s = axis_sizes["tensor"], config.jnp_dtype.itemsize
    d, hd = config.hidden_size, config.head_dim
    i = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size
    qkv_cols = (config.num_heads + 2 * config.num_kv_heads) * hd
    per_layer = (d + config.qkv_bias) * divided(qkv_cols, t) + (d + config.mlp_bias) * divided(2 * i, t)
    copied = config.dtype != config.param_dtype or axis_sizes["fsdp"] > 1
    if copied:
        per_layer += divided(config.num_heads * hd, t) * d + d * config.o_bias
        per_layer += divided(i, t) * d + d * config.mlp_bias
        # MoE: the router and every expert's matrices, cast (they are not concatenated: else the parameters)
        per_layer += config.num_experts * (d + 3 * d * divided(config.moe_intermediate_size, t))
    return config.num_layers * per_layer * s


def packed_weight_bytes(config: ModelConfig) -> int:
    """Bytes of the engine's AMX-packed decode weights (`engine.model.pack_step_weights`, one CPU device): every
    layer's q|k|v, o, gate|up and down and the LM head `[D, V]` in bfloat16, K rounded up to 32 rows and the head's
    columns to 16 (`cpu_kernel.pack_weight`; the layers' widths are whole tiles where they pack)."""
    d, hd = config.hidden_size, config.head_dim
    i = config.shared_expert_intermediate_size if config.is_moe else config.intermediate_size  # experts: unpacked
    up32 = lambda k: -(-k // 32) * 32  # noqa: E731
    per_layer = (up32(d) * (config.num_heads + 2 * config.num_kv_heads) * hd + up32(config.num_heads * hd) * d
                 + up32(d) * 2 * i + up32(i) * d)
    return 2 * (config.num_layers * per_layer + up32(d) * -(-config.vocab_size // 16) * 16)


