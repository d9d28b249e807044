"""The layer stack, driven in one place: every path that runs the model (the training forward and the log-prob
passes, the static sampler's prefill and token step, the rollout engine's prefill and decode steps) embeds its tokens,
calls `run_layers`, and applies the final norm and the head its own way.

    for i in range(L):
        ops, attend, cos, sin = layer(i, weights[i], states[i], per_layer[i])
        x, states[i], routing[i] = transformer_block(x, ops, attend, cos, sin)

What differs between the paths is a part the path hands in (`LayerFn`): how a layer's weights are applied
(`block.LayerOps`: the Flax modules with LoRA and dropout, or the sampler's fused weights), where its keys and values
live (`block.Attend`: none, a cache, pages, a slot cache) and its rotary tables; what a layer carries from call to call
is its `state` (a KV cache, pages). An MoE model's routing replay is a per-layer input (`per_layer`), and every path
gets the layers' `Routing` back, stacked.

Two ways to loop over the same body:
- `scanned` (training): `lax.scan` over stacked `[L, ...]` weights, states and per-layer inputs: one layer compiled,
  the layer index traced (a layer's kind is then selected on the device), optionally rematerialised (`checkpoint`);
- unrolled (the samplers): over per-layer lists, each layer's weights and cache their own buffers, so a decode
  loop writes a token's keys and values in place; the index is a Python int, so each layer's kind is static.

Stacks whose layers differ in their weights (a hybrid stack: Qwen3.5's three linear-attention layers per softmax
one) keep one `layers` tree whose parts are stacked over the layers that have them (`ModelConfig.layers_holding`:
`attn [L_full, ...]`, `linear_attn [L_linear, ...]`, the norms and the MLP `[L, ...]`). Scanned, such a stack runs
one *period* of its pattern per scan step (`layer_period`: 4 layers for Qwen3.5, unrolled inside the step), so one
period is compiled; `layer_weights` gives one layer's weights for the unrolled paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models.block import Attend, LayerOps, transformer_block
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.moe import Routing


class LayerParts(NamedTuple):
    """One layer's parts on one path: its weights as functions (`ops`), its attention over its state (`attend`) and
    its rotary tables `cos, sin [B, T, rot]`."""

    ops: LayerOps
    attend: Attend
    cos: jax.Array
    sin: jax.Array


# `layer(i, weights, state, per_layer) -> LayerParts`: `i` a Python int (unrolled) or a traced int32 (scanned);
# `weights`, `state`, `per_layer` layer i's (None where the path has none).
LayerFn = Callable[[Any, Any, Any, Any], LayerParts]


class StackOutput(NamedTuple):
    """`run_layers`' result: the last layer's output `x [B, T, D]` (before the final norm), the layers' states (a list
    unrolled, stacked `[L, ...]` scanned; None without) and every layer's `Routing` stacked `[L, ...]` (None for a
    dense model)."""

    x: jax.Array
    states: Any
    routing: Routing | None


def layer_period(config: ModelConfig) -> int:
    """The fewest layers after which a stack's pattern of weight kinds (linear attention or not) repeats and that
    divide `L` (1 when every layer is alike; `L` when there is no pattern)."""
    kinds = [config.is_linear(i) for i in range(config.num_layers)]
    n = config.num_layers
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def merge_kinds(config: ModelConfig, full: Any, linear: Any) -> Any:
    """A hybrid stack's one `layers` tree from its two kinds' stacked trees (`full` over the softmax-attention layers,
    `linear` over the linear ones): each kind keeps its mixer (`attn`, `linear_attn`), the parts every layer has are
    interleaved into layer order `[L, ...]`."""
    order = config.layers_holding("attn") + config.layers_holding("linear_attn")
    inverse = jnp.argsort(jnp.asarray(order))
    merged = {k: jax.tree.map(lambda a, b: jnp.concatenate([a, b])[inverse], v, linear[k])
              for k, v in full.items() if k != "attn"}
    return {**merged, "attn": full["attn"], "linear_attn": linear["linear_attn"]}


def layer_weights(config: ModelConfig, stacked: Any, i: int) -> Any:
    """Layer `i`'s weights from the stacked `layers` tree (a static slice of each part that layer has)."""
    out = {}
    for part, tree in stacked.items():
        holders = config.layers_holding(part)
        if i in holders:
            slot = holders.index(i)
            out[part] = jax.tree.map(lambda a, slot=slot: a[slot], tree)
    return out


def _period_weights(config: ModelConfig, stacked: Any) -> list[Any]:
    """A hybrid stack's weights as the `layer_period` layers of one period, each part `[L / p, ...]` (period-major):
    what one scan step over periods reads."""
    p = layer_period(config)
    n = config.num_layers // p
    out = []
    for j in range(p):
        layer = {}
        for part, tree in stacked.items():
            holders = config.layers_holding(part)
            if j in holders:
                per, slot = len(holders) // n, holders.index(j)
                layer[part] = jax.tree.map(lambda a, per=per, slot=slot: a.reshape(n, per, *a.shape[1:])[:, slot],
                                           tree)
        out.append(layer)
    return out


def run_layers(x: jax.Array, config: ModelConfig, layer: LayerFn, weights: Any, states: Any = None,
               per_layer: Any = None, *, scanned: bool = False, carry: Callable[[jax.Array], jax.Array] | None = None,
               checkpoint: Callable[[Callable], Callable] | None = None) -> StackOutput:
    """The `L = config.num_layers` blocks on `x [B, T, D]` (the module docstring's loop).

    `weights`, `states`: per-layer lists (unrolled) or pytrees stacked on a leading `[L]` axis (`scanned`); `states`
    None where the path keeps none. `per_layer`: a pytree with a leading `[L]` axis (sliced per layer) or None.
    `carry(x)`: applied to the activations between layers (a sharding constraint). `checkpoint(step)`: wraps the
    scanned step (rematerialisation)."""
    fix = carry or (lambda a: a)

    def step(x: jax.Array, i: Any, w: Any, state: Any, extra: Any) -> tuple[jax.Array, tuple[Any, Routing | None]]:
        ops, attend, cos, sin = layer(i, w, state, extra)
        x, state, routing = transformer_block(fix(x), ops, attend, cos, sin, config)
        return fix(x), (state, routing)

    n = config.num_layers
    if scanned and config.is_hybrid:
        return _run_periods(x, config, step, weights, states, per_layer, checkpoint)
    if scanned:
        def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, tuple[Any, Routing | None]]:
            return step(x, *xs)

        body = checkpoint(body) if checkpoint is not None else body
        x, (states, routing) = jax.lax.scan(body, x, (jnp.arange(n, dtype=jnp.int32), weights, states, per_layer),
                                            unroll=config.scan_unroll)
        return StackOutput(x, states, routing)
    out_states, routes = [], []
    for i in range(n):
        extra = None if per_layer is None else jax.tree.map(lambda a, i=i: a[i], per_layer)
        x, (state, routing) = step(x, i, weights[i], None if states is None else states[i], extra)
        out_states.append(state)
        routes.append(routing)
    routing = None if routes[0] is None else jax.tree.map(lambda *r: jnp.stack(r), *routes)
    return StackOutput(x, None if states is None else out_states, routing)


def _run_periods(x: jax.Array, config: ModelConfig, step: Callable, weights: Any, states: Any, per_layer: Any,
                 checkpoint: Callable[[Callable], Callable] | None) -> StackOutput:
    """`run_layers`' scanned loop over a hybrid stack: `lax.scan` over its periods (`layer_period`), the layers of
    one period unrolled in the step, each with its own kind of weights."""
    if states is not None:
        raise ValueError("a hybrid layer stack is scanned without per-layer states (the samplers run it unrolled)")
    p = layer_period(config)
    n = config.num_layers // p
    extras = None if per_layer is None else jax.tree.map(lambda a: a.reshape(n, p, *a.shape[1:]), per_layer)

    def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, Routing | None]:
        period, ws, extra = xs
        routes = []
        for j in range(p):
            e = None if extra is None else jax.tree.map(lambda a, j=j: a[j], extra)
            x, (_, routing) = step(x, period * p + j, ws[j], None, e)
            routes.append(routing)
        return x, None if routes[0] is None else jax.tree.map(lambda *r: jnp.stack(r), *routes)

    body = checkpoint(body) if checkpoint is not None else body
    x, routing = jax.lax.scan(body, x, (jnp.arange(n, dtype=jnp.int32), _period_weights(config, weights), extras))
    if routing is not None:
        routing = jax.tree.map(lambda a: a.reshape(n * p, *a.shape[2:]), routing)
    return StackOutput(x, None, routing)


def chosen_experts(routing: Routing | None) -> jax.Array | None:
    """The experts every MoE layer chose, `[..., L, k]` int16 (the record a rollout keeps for routing replay), from
    `run_layers`' stacked `Routing` (`experts [L, ..., k]`); None for a dense model."""
    if routing is None:
        return None
    return jnp.moveaxis(routing.experts, 0, -2).astype(jnp.int16)
