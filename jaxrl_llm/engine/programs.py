"""The engine's device programs (jitted; static shapes, so a run compiles a bounded set):

- `prefill_program`: a chunk of prompt tokens `[R, C]` per row written into the rows' pages; the logits of each
  row's last real token;
- `decode_program`: `steps` decode steps of every slot `[S]` in one call (the host is not in the inner loop); a
  slot that finished (EOS, its token limit) or is empty computes on padding and writes nothing;
- `first_tokens_program`: the first token of each sample from its prompt's last logits;
- `copy_pages_program`: copy on write of shared pages.

A row's token at completion index `i` is drawn with the uniform `U(fold_in(row_key, i))`: its own key and
position, whatever slot or batch it lands in, so a seed gives the same tokens under any scheduling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.model import (
    PackedWeights,
    call_rotary,
    kernel_decode_step,
    pack_step_weights,
    packed_logits,
    paged_forward,
    paged_logits,
    slot_caches,
    slot_decode_step,
    step_rotary,
    write_back,
)
from jaxrl_llm.engine.pages import PagedLayer, copy_pages
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import split_layers
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.moe import NO_RECORD
from jaxrl_llm.models.step_weights import StepWeights, constrain_step_weights, fusable_shards, step_weights
from jaxrl_llm.sampling.config import Knobs
from jaxrl_llm.sampling.logits import sample_with_uniform
from jaxrl_llm.sharding import BATCH_AXES, constrain


class SamplingFlags(NamedTuple):
    """What changes the decode program (static): greedy, which truncations are on, the EOS ids, the pad id."""

    greedy: bool
    top_k: bool
    top_p: bool
    min_p: bool
    eos_ids: tuple[int, ...]
    pad_id: int


class SlotState(NamedTuple):
    """The decode slots `[S]`: the token to feed next and its position, page tables `[S, M]`, each row's key data
    `[S, 2]` (uint32), the completion index of the next token to sample, how many it may still sample, and
    whether the slot is decoding."""

    token: jax.Array
    position: jax.Array
    page_table: jax.Array
    key_data: jax.Array
    index: jax.Array
    remaining: jax.Array
    active: jax.Array


class StepOutputs(NamedTuple):
    """What `steps` decode steps emitted per slot: tokens, log-probs and untruncated log-probs `[S, steps]`
    (pad / 0 where the slot was not active), whether the slot stopped on EOS `[S]`, and for an MoE model the experts
    each step's fed token was routed to `[S, steps, L, k]` int16 (`moe.NO_RECORD` where inactive; else None)."""

    tokens: jax.Array
    logprobs: jax.Array
    untruncated: jax.Array
    hit_eos: jax.Array
    experts: jax.Array | None = None


def weight_shards(config: ModelConfig, mesh: Mesh | None) -> int:
    """The tensor-parallel shards the fused step weights are laid out for on `mesh` (`fusable_shards`)."""
    return fusable_shards(config, mesh.shape["tensor"]) if mesh is not None else 1


def constrain_pages(pages: list[PagedLayer], mesh: Mesh | None) -> list[PagedLayer]:
    """The pool's placement on a mesh: KV heads over `tensor` (where they divide), every page on every device of
    the other axes (a page table may point anywhere in the pool)."""
    return [{name: constrain(pool, mesh, PartitionSpec("tensor")) for name, pool in layer.items()} for layer in pages]


def replicated(tree: object, mesh: Mesh | None) -> object:
    """`tree`'s arrays whole on every device of `mesh`: what the host reads back after a call."""
    return jax.tree.map(lambda x: constrain(x, mesh, PartitionSpec()), tree)


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def prepare_weights(params: Params, config: ModelConfig, mesh: Mesh | None = None) -> list[StepWeights]:
    """The block's fused per-layer weights (`models/decode.py: step_weights`), made once per generate call; on a
    mesh gathered over `fsdp` and split over `tensor` (`constrain_step_weights`), as the static sampler's."""
    weights = step_weights(split_layers(params, config), config, weight_shards(config, mesh))
    return [constrain_step_weights(w, mesh) for w in weights]


@functools.partial(jax.jit, static_argnames=("config",))
def pack_weights(params: Params, weights: list[StepWeights], *, config: ModelConfig) -> PackedWeights:
    """The decode step's weights for the CPU's AMX matmul (`model.pack_step_weights`), made once per generate call
    beside `prepare_weights`' (the prefill keeps XLA's matmuls, faster at its many rows)."""
    return pack_step_weights(params, weights, config)


def row_uniforms(key_data: jax.Array, index: jax.Array) -> jax.Array:
    """`[R]` uniforms in [0, 1): row r's draw for its completion index `index[r]`."""
    def one(data: jax.Array, i: jax.Array) -> jax.Array:
        return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(data), i), (), jnp.float32)

    return jax.vmap(one)(key_data, index)


def _sample(logits: jax.Array, uniform: jax.Array, knobs: Knobs, flags: SamplingFlags, kernel: bool = False
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sample_with_uniform`; with `kernel` (the CPU), an untruncated draw through `cpu_kernel.inverse_cdf_sample`:
    the same draw in one pass over the logits, where XLA:CPU makes four (5.4 ms of a 128-row SmolLM2 step)."""
    if kernel and not (flags.greedy or flags.top_k or flags.top_p or flags.min_p):
        token, logprob = cpu_kernel.inverse_cdf_sample(logits, uniform, knobs.temperature)
        return token, logprob, logprob
    return sample_with_uniform(logits, uniform, knobs, greedy=flags.greedy, use_top_k=flags.top_k,
                               use_top_p=flags.top_p, use_min_p=flags.min_p)


@functools.partial(jax.jit, static_argnames=("config", "attention", "mesh"), donate_argnames=("pages",))
def prefill_program(params: Params, weights: list[StepWeights], pages: list[PagedLayer], tokens: jax.Array,
                    positions: jax.Array, page_table: jax.Array, last: jax.Array, *, config: ModelConfig,
                    attention: str = "xla", mesh: Mesh | None = None, head: jax.Array | None = None
                    ) -> tuple[jax.Array, list[PagedLayer], jax.Array | None]:
    """`tokens, positions [R, C]` (position -1: padding) written into pages; returns the float32 logits `[R, V]`
    at column `last [R]` of each row, the pages, and an MoE model's chosen experts `[R, C, L, k]` (else None).
    `attention`: `cpu` attends through the CPU kernel, any other backend with XLA's dots over the gathered pages
    (the Pallas kernels take one query per row). `head`: the decode
    step's AMX-packed LM head (`PackedWeights.head`), for the logits (no cast of the whole embedding per call)."""
    hidden, pages, experts = paged_forward(params, weights, config, tokens, positions, page_table, pages,
                                           weight_shards(config, mesh), "cpu" if attention == "cpu" else "xla")
    picked = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = paged_logits(params, config, picked) if head is None else packed_logits(head, config, picked)
    return replicated(logits, mesh), constrain_pages(pages, mesh), replicated(experts, mesh)


@functools.partial(jax.jit, static_argnames=("flags",))
def first_tokens_program(logits: jax.Array, parent_key_data: jax.Array, sample: jax.Array, knobs: Knobs, *,
                         flags: SamplingFlags) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Each sample's key data `fold_in(parent key, sample)` `[R, 2]` and its completion token 0 (token, log-prob,
    untruncated log-prob) from `logits [R, V]` (a group's rows repeat their prompt's logits)."""
    def derive(data: jax.Array, j: jax.Array) -> jax.Array:
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(data), j))

    key_data = jax.vmap(derive)(parent_key_data, sample)
    return key_data, _sample(logits, row_uniforms(key_data, jnp.zeros(logits.shape[:1], jnp.int32)), knobs, flags)


@functools.partial(jax.jit, donate_argnames=("pages",))
def copy_pages_program(pages: list[PagedLayer], source: jax.Array, target: jax.Array) -> list[PagedLayer]:
    return copy_pages(pages, source, target)


@functools.partial(jax.jit, static_argnames=("config", "flags", "steps", "attention", "mesh"),
                   donate_argnames=("pages",))
def decode_program(params: Params, weights: list[StepWeights] | PackedWeights, pages: list[PagedLayer],
                   state: SlotState, knobs: Knobs, *, config: ModelConfig, flags: SamplingFlags, steps: int,
                   attention: str = "xla", mesh: Mesh | None = None) -> tuple[SlotState, StepOutputs, list[PagedLayer]]:
    """`steps` decode steps of every slot: feed `state.token` at `state.position`, sample the next token at
    completion index `state.index`; a slot stops at EOS or when `remaining` reaches 0. Returns the new state, the
    tokens emitted `[S, steps]` and the pages. `attention` (`kernels.attention_backend`): `xla` decodes over
    contiguous per-call slot caches gathered once; a kernel (Pallas, or the CPU's C++ one) attends over the pages on
    every step (with `PackedWeights`, `pack_weights`, on the CPU's AMX matmul). On a `mesh` the slots are split over
    `("data", "fsdp")` and the KV heads over `tensor`; the results come back whole on every device."""
    shards, eos = weight_shards(config, mesh), jnp.asarray(flags.eos_ids, jnp.int32)
    rotary = call_rotary(config, state.position, steps) if attention != "xla" else None
    kernel_sampling = attention == "cpu" and cpu_kernel.sampling_unavailable_reason() is None

    def step(j: jax.Array, carry: tuple) -> tuple:
        s, out, caches = carry
        position = jnp.where(s.active, s.position, -1)
        if attention == "xla":
            logits, caches, routed = slot_decode_step(params, weights, config, s.token, position, caches, shards)
        else:  # `caches` are the pages themselves
            logits, caches, routed = kernel_decode_step(params, weights, config, s.token, position, s.page_table,
                                                        caches, attention, shards, step_rotary(rotary, j))
        token, logprob, untruncated = _sample(logits, row_uniforms(s.key_data, s.index), knobs, flags,
                                              kernel_sampling)
        token = jnp.where(s.active, token, flags.pad_id)
        hit = s.active & (jnp.any(token[:, None] == eos, axis=-1) if flags.eos_ids else False)
        recorded = None if routed is None else out.experts.at[:, j].set(  # type: ignore[union-attr]
            jnp.where(s.active[:, None, None], routed, NO_RECORD))
        out = StepOutputs(out.tokens.at[:, j].set(token),
                          out.logprobs.at[:, j].set(jnp.where(s.active, logprob, 0.0)),
                          out.untruncated.at[:, j].set(jnp.where(s.active, untruncated, 0.0)), out.hit_eos | hit,
                          recorded)
        step_ = s.active.astype(jnp.int32)
        remaining = s.remaining - step_
        s = SlotState(token, s.position + step_, s.page_table, s.key_data, s.index + step_, remaining,
                      s.active & ~hit & (remaining > 0))
        return s, out, caches

    def run(caches: object) -> tuple:
        # A while loop, not `steps` fixed iterations: the call ends as soon as every slot has finished, so a
        # short completion limit (or a batch that all hit EOS) costs its own steps, not `steps`.
        def going(carry: tuple) -> jax.Array:
            return (carry[0] < steps) & jnp.any(carry[1].active)

        def body(carry: tuple) -> tuple:
            j, s, out, caches = carry
            return (j + 1, *step(j, (s, out, caches)))

        empty = _no_outputs(state.token.shape[0], steps, config, flags.pad_id)
        _, s, out, caches = jax.lax.while_loop(going, body, (jnp.int32(0), state, empty, caches))
        return s, out, caches

    if attention != "xla":
        state, out, pages = run(pages)
    else:
        state, out, pages = _over_slot_caches(run, pages, state, steps, config, mesh)
    return replicated(state, mesh), replicated(out, mesh), constrain_pages(pages, mesh)


def _no_outputs(slots: int, steps: int, config: ModelConfig, pad_id: int) -> StepOutputs:
    """A decode call's outputs before its first step: padding tokens, zero log-probs, no EOS hit and (MoE) no
    recorded experts."""
    experts = (jnp.full((slots, steps, config.num_layers, config.num_experts_per_tok), NO_RECORD, jnp.int16)
               if config.is_moe else None)
    return StepOutputs(jnp.full((slots, steps), pad_id, jnp.int32), jnp.zeros((slots, steps), jnp.float32),
                       jnp.zeros((slots, steps), jnp.float32), jnp.zeros((slots,), bool), experts)


def _over_slot_caches(run: Callable[[object], tuple], pages: list[PagedLayer], state: SlotState, steps: int,
                      config: ModelConfig, mesh: Mesh | None) -> tuple[SlotState, StepOutputs, list[PagedLayer]]:
    """The XLA path's decode call: each slot's context gathered once into contiguous caches (not per token), the
    steps `run` over them, and the call's tokens written back into the pages at its end."""
    caches = [{name: constrain(x, mesh, PartitionSpec(BATCH_AXES, "tensor")) for name, x in cache.items()}
              for cache in slot_caches(pages, state.page_table)]
    new, out, caches = run(caches)
    j = jnp.arange(steps)[None, :]
    written = jnp.where(j < (new.index - state.index)[:, None], state.position[:, None] + j, -1)  # fed positions
    return new, out, write_back(pages, caches, state.page_table, written, config.jnp_dtype)
