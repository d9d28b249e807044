"""The decoder over a paged KV cache: the layer stack (`models/stack.py: run_layers`) on the sampler's prepared
weights (`models/step_weights.py: step_ops`), its attention reading and writing pages (`pages.py`).

- `paged_forward` runs `T` tokens per row at explicit positions (`-1` = padding: neither written nor attended
  from), writes their keys and values into the rows' pages and attends over each row's gathered pages: a prefill
  chunk (the gather is shared by the chunk's `T` queries).
- `kernel_decode_step`: a decode step straight over the pages with a paged-attention kernel (`kernels.py`: Pallas
  on GPU and TPU, the C++ one on the CPU). On a CPU with AMX and a bfloat16 model its matmuls run on weights packed
  once per generate call (`pack_step_weights`, `cpu_kernel.packed_matmul`).
- `slot_caches` + `slot_decode_step` (the XLA path: a CPU without a C++ compiler, an engine on several devices): the
  decode steps of one engine call. Gathering
  every row's pages on every token would copy the whole context per token (on XLA:CPU that copy costs more than the
  attention itself), so a call gathers each slot's context once into contiguous caches in the layout the static
  sampler's token step reads (keys `[S, KVH, hd, C]`, values `[S, KVH, C, hd]`, `models/decode.py: loop_caches`);
  each step writes its token into the call's caches, and the call's tokens go to the pages at its end (`write_back`:
  the pages stay the record a kept conversation continues from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.kernels import paged_decode_attention
from jaxrl_llm.engine.pages import (
    PagedLayer,
    context_allowed,
    from_storage,
    gather_pages,
    page_slots,
    pool_geometry,
    to_storage,
    write_pages,
)
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.attention import UNROLLED_LENGTH, AttentionMask, blocked_attention, xla_attention
from jaxrl_llm.models.block import Attend, LayerOps, attention_spec, layer_kinds_present
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import longrope_original, loop_layout_attention
from jaxrl_llm.models.decoder import Params, embed, final_norm, unembed, unembedding_as_stored
from jaxrl_llm.models.layers import rms_norm, rope_cos_sin, softcap
from jaxrl_llm.models.precision import matmul
from jaxrl_llm.models.stack import LayerParts, chosen_experts, run_layers
from jaxrl_llm.models.step_weights import StepWeights, mlp_width, step_ops


def engine_context_problem(config: ModelConfig, longest: int) -> str | None:
    """Why the engine cannot sample a call that may reach `longest` tokens (its prompt plus its token limit), or
    None. A longrope model (Phi-3.5 style) switches to its long factors for a whole batch once the batch reaches past
    its original context (transformers' dynamic update), which a per-row engine cannot reproduce; within that context
    the short factors hold for every row, exactly."""
    original = longrope_original(config)
    if original is not None and longest > original:
        return (f"the rollout engine runs a longrope model (Phi-3.5 style) within its original context of "
                f"{original} tokens, and this call may reach {longest}")
    return None


def check_engine_context(config: ModelConfig, longest: int) -> None:
    """`ConfigError` where `engine_context_problem` names one (a caller that cannot hand the call to the static
    sampler: the multi-turn rollout, whose conversations the engine keeps)."""
    why = engine_context_problem(config, longest)
    if why is not None:
        raise ConfigError(f"{why}: use sampling.engine=static, or a shorter sampling.max_new_tokens or "
                          "data.max_prompt_tokens")


def layer_inputs(config: ModelConfig, positions: jax.Array, context: int
                 ) -> dict[bool, tuple[jax.Array, jax.Array, jax.Array]]:
    """Per layer kind (sliding or not): rotary tables `cos, sin [R, T, rot]` at `positions [R, T]` (padding at 0)
    and the mask `[R, T, context]` of the keys each query may read."""
    c, clamped = config, jnp.maximum(positions, 0)
    return {local: (*rope_cos_sin(c, clamped, local=local),
                    context_allowed(positions, context, c.sliding_window if local else None))
            for local in sorted({c.is_sliding(i) for i in range(c.num_layers)})}


Rotary = dict[bool, tuple[jax.Array, jax.Array]]


def call_rotary(config: ModelConfig, start: jax.Array, steps: int) -> Rotary:
    """Per layer kind (sliding or not), the rotary tables `cos, sin [S, steps, rot]` of a decode call's positions
    `start + j` (`start [S]`, `j < steps`): what a slot still decoding feeds at step `j` (an idle slot's rows are
    never read). Made once per call and sliced per step (`step_rotary`): computed inside the step, XLA:CPU fuses
    cos and sin into every layer's rotation of q and of k and evaluates them per head and per layer (3.8 ms of a
    128-row SmolLM2 step, docs/engine.md); a slice is a load. Exact for longrope too: the engine stays within its
    original context (`check_engine_context`), where its factors do not switch."""
    positions = jnp.maximum(start, 0)[:, None] + jnp.arange(steps, dtype=start.dtype)
    return {local: rope_cos_sin(config, positions, local=local)
            for local in sorted({config.is_sliding(i) for i in range(config.num_layers)})}


def step_rotary(rotary: Rotary, j: jax.Array) -> Rotary:
    """Step `j`'s tables `[S, 1, rot]` of `call_rotary`'s."""
    return {local: (jax.lax.dynamic_slice_in_dim(cos, j, 1, axis=1), jax.lax.dynamic_slice_in_dim(sin, j, 1, axis=1))
            for local, (cos, sin) in rotary.items()}


def paged_attention(config: ModelConfig, layer: PagedLayer, page_table: jax.Array, slots: jax.Array,
                    positions: jax.Array, local: bool) -> Attend:
    """Grouped-query attention over pages: the new keys and values written at `slots [R, T]`, then each row's
    queries, at `positions [R, T]` (-1: padding), attend to its gathered context `[R, M * page_size]` through the
    training attention's XLA path (`models.attention`): the mask is the positions (a key slot is its position), built
    a query chunk at a time (`model.attention_query_chunk`), so a long prompt's chunk never holds a
    `[R, T, M * page_size]` mask or all its scores at once; past `UNROLLED_LENGTH` context slots, in blocks of keys
    too (`blocked_attention`: the blocks past every row's position are skipped)."""
    c = config

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, PagedLayer]:
        new = write_pages(layer, slots, k, v, c.jnp_dtype)
        keys, values = (jnp.transpose(from_storage(x, c.jnp_dtype), (1, 2, 0, 3))  # [R, C, KVH, hd]
                        for x in gather_pages(new, page_table))
        mask, spec, chunk = AttentionMask.at_positions(positions, keys.shape[1]), attention_spec(c, local), \
            c.attention_query_chunk
        if chunk and keys.shape[1] > UNROLLED_LENGTH:  # a long context: key blocks past every position skipped
            out = blocked_attention(q, keys, values, mask, spec, sinks=sinks, block=chunk, compute_dtype=c.jnp_dtype)
        else:
            out = xla_attention(q, keys, values, mask, spec, sinks=sinks, query_chunk=chunk,
                                compute_dtype=c.jnp_dtype)
        return out, new

    return attend


def paged_forward(params: Params, weights: list[StepWeights], config: ModelConfig, tokens: jax.Array,
                  positions: jax.Array, page_table: jax.Array, pages: list[PagedLayer], shards: int = 1,
                  attention: str = "xla") -> tuple[jax.Array, list[PagedLayer], jax.Array | None]:
    """`tokens, positions [R, T]` through the decoder over `pages` with page tables `[R, M]`: returns the final
    hidden states `[R, T, D]` (after the final norm), the pages with the tokens' keys and values written, and an
    MoE model's chosen experts `[R, T, L, k]` (`stack.chosen_experts`; None for a dense model).
    `attention`: `cpu` attends through the CPU kernel (`kernel_attention`, each query a kernel row over its own
    sequence's pages), else XLA's dots over the gathered pages."""
    c = config
    num_pages, page_size = pool_geometry(pages)
    slots = page_slots(page_table, positions, page_size, num_pages)
    rotary = {local: rope_cos_sin(c, jnp.maximum(positions, 0), local=local) for local in layer_kinds_present(c)}
    if attention == "cpu":  # the kernel's rows, one per query; a padding query (position -1) reads nothing
        query_tables, query_lengths = jnp.repeat(page_table, positions.shape[1], axis=0), (positions + 1).reshape(-1)

    def layer(i: int, w: StepWeights, paged: PagedLayer, _: None) -> LayerParts:
        if attention == "cpu":
            window = c.sliding_window if c.is_sliding(i) else None
            attend = kernel_attention(c, paged, query_tables, slots, query_lengths, "cpu", window)
        else:
            attend = paged_attention(c, paged, page_table, slots, positions, c.is_sliding(i))
        return LayerParts(step_ops(w, c, shards), attend, *rotary[c.is_sliding(i)])

    out = run_layers(embed(params, c, tokens), c, layer, weights, pages)
    return final_norm(params, c, out.x), out.states, chosen_experts(out.routing)


def slot_caches(pages: list[PagedLayer], page_table: jax.Array) -> list[dict[str, jax.Array]]:
    """Each slot's context gathered from its pages `[S, M]` into contiguous caches: keys `[S, KVH, hd, M * ps]`,
    values `[S, KVH, M * ps, hd]` (the decode loop's layout), as stored (`pages.storage_dtype`)."""
    out = []
    for layer in pages:
        k, v = gather_pages(layer, page_table)  # [KVH, S, C, hd]
        out.append({"k": jnp.transpose(k, (1, 0, 3, 2)), "v": jnp.swapaxes(v, 0, 1)})
    return out


def slot_attention(config: ModelConfig, cache: dict[str, jax.Array], positions: jax.Array,
                   allowed: jax.Array) -> Attend:
    """One new token per slot, written into the call's contiguous cache at each slot's own position
    `positions [S]`, then attention over that cache under `allowed [S, 1, C]` (the static sampler's contraction
    layout). The pages get the call's tokens once, at its end (`write_back`)."""
    dtype = config.jnp_dtype

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
        rows, at = jnp.arange(q.shape[0]), jnp.maximum(positions, 0)
        k_all = cache["k"].at[rows, :, :, at].set(to_storage(k[:, 0], dtype))
        v_all = cache["v"].at[rows, :, at].set(to_storage(v[:, 0], dtype))
        out = loop_layout_attention(q, from_storage(k_all, dtype), from_storage(v_all, dtype), allowed, config, sinks)
        return out, {"k": k_all, "v": v_all}

    return attend


def slot_decode_step(params: Params, weights: list[StepWeights], config: ModelConfig, tokens: jax.Array,
                     positions: jax.Array, caches: list[dict[str, jax.Array]], shards: int = 1
                     ) -> tuple[jax.Array, list[dict[str, jax.Array]], jax.Array | None]:
    """One decode step of every slot over the call's caches: `tokens [S]` at `positions [S]` (-1: an idle slot,
    whose write lands on slot 0 of its own cache and is never read). Returns float32 logits `[S, V]`, the
    caches with the tokens written and an MoE model's chosen experts `[S, L, k]` (else None)."""
    c = config
    context = caches[0]["k"].shape[-1]
    inputs = layer_inputs(c, positions[:, None], context)

    def layer(i: int, w: StepWeights, cache: dict[str, jax.Array], _: None) -> LayerParts:
        cos, sin, allowed = inputs[c.is_sliding(i)]
        return LayerParts(step_ops(w, c, shards), slot_attention(c, cache, positions, allowed), cos, sin)

    out = run_layers(embed(params, c, tokens[:, None]), c, layer, weights, caches)
    experts = chosen_experts(out.routing)
    return (paged_logits(params, c, final_norm(params, c, out.x[:, 0])), out.states,
            None if experts is None else experts[:, 0])


def write_back(pages: list[PagedLayer], caches: list[dict[str, jax.Array]], page_table: jax.Array,
               positions: jax.Array, dtype: jnp.dtype) -> list[PagedLayer]:
    """The call's new tokens copied from its caches into the pages: `positions [S, steps]` (-1: none)."""
    num_pages, page_size = pool_geometry(pages)
    slots = page_slots(page_table, positions, page_size, num_pages)
    at = jnp.maximum(positions, 0)
    out = []
    for layer, cache in zip(pages, caches, strict=True):
        k = jnp.take_along_axis(cache["k"], at[:, None, None, :], axis=3).transpose(0, 3, 1, 2)  # [S, steps, KVH, hd]
        v = jnp.take_along_axis(cache["v"], at[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
        out.append(write_pages(layer, slots, from_storage(k, dtype), from_storage(v, dtype), dtype))
    return out


def kernel_attention(config: ModelConfig, layer: PagedLayer, page_table: jax.Array, slots: jax.Array,
                     lengths: jax.Array, backend: str, window: int | None = None) -> Attend:
    """`T` new tokens per row written into its pages at `slots [R, T]`, then a paged-attention kernel over the pool
    (`kernels.py`: Pallas on GPU and TPU, C++ on the CPU) with each of the `R x T` queries one kernel row: the first
    `lengths [R * T]` positions through `page_table [R * T, M]` (the last `window` of them on a sliding-window
    layer; the Pallas kernels have none). A decode step has `T = 1`; a prefill chunk on the CPU `T > 1`
    (`paged_forward`: XLA's batched form of that attention spends most of its time transposing q, the scores and
    the output, bench/README.md)."""
    c = config

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, PagedLayer]:
        if sinks is not None:  # `kernels.attention_backend` keeps a model with sinks on the XLA path
            raise ValueError("the paged-attention kernels have no attention sinks; decode this model on the XLA path")
        new = write_pages(layer, slots, k, v, c.jnp_dtype)
        r, t = q.shape[:2]
        out = paged_decode_attention(q.reshape(r * t, *q.shape[2:]), new["k"], new["v"], page_table, lengths, c,
                                     backend, window)
        return out.reshape(r, t, -1), new

    return attend


class PackedWeights(NamedTuple):
    """The decode step's weights for the CPU's AMX matmul (`cpu_kernel.packed_matmul`): the layers' matrices packed
    where they can be (`cpu_kernel.packable`; others stay as they are), gate|up for the kernel's activation
    epilogue where it can be (`gated_in_kernel`: `cpu_kernel.pack_gated_weight`), and the LM head `[D, V]` packed
    (its columns padded to whole tiles where V needs it)."""

    layers: list[StepWeights]
    head: jax.Array


def gated_in_kernel(config: ModelConfig) -> bool:
    """Whether the packed decode step computes the MLP's `act(gate) * up` in the AMX kernel's epilogue
    (`cpu_kernel.packed_gated_matmul`): an MLP without biases whose width packs whole (a multiple of 16)."""
    return not config.mlp_bias and mlp_width(config) % 16 == 0


def pack_step_weights(params: Params, weights: list[StepWeights], config: ModelConfig) -> PackedWeights:
    """`weights`' matrices and the LM head (the tied embedding transposed) in the AMX kernel's tile layout."""
    def pack(w: jax.Array | None) -> jax.Array | None:
        return cpu_kernel.pack_weight(w) if w is not None and cpu_kernel.packable(w) else w

    def pack_gate_up(w: jax.Array | None) -> jax.Array | None:
        return cpu_kernel.pack_gated_weight(w) if w is not None and gated_in_kernel(config) else pack(w)

    head, transposed = unembedding_as_stored(params, config)
    head = head.T if transposed else head
    return PackedWeights([w._replace(qkv=pack(w.qkv), o=pack(w.o), gate_up=pack_gate_up(w.gate_up), down=pack(w.down))
                          for w in weights], cpu_kernel.pack_weight(head))


def packed_or_plain(config: ModelConfig) -> Callable[..., jax.Array]:
    """`step_ops`' `dense_matmul` over `PackedWeights`: a packed matrix (4-D) through the AMX kernel, any other
    under the precision policy; with a pre-norm's `scale`, `rms_norm` first (in the kernel where it packs)."""
    def apply(x: jax.Array, kernel: jax.Array, scale: jax.Array | None = None) -> jax.Array:
        if kernel.ndim == 4:
            return cpu_kernel.packed_matmul(x, kernel, norm=kernel_norm(config, scale))
        if scale is not None:
            x = rms_norm(x, scale, config.rms_norm_eps, unit_offset=config.norm_unit_offset)
        return matmul(x, kernel, config.jnp_dtype)
    return apply


def kernel_norm(config: ModelConfig, scale: jax.Array | None) -> cpu_kernel.Norm | None:
    """The model's RMS norm of `scale` for the AMX kernel to apply to its rows (None: no norm)."""
    return None if scale is None else cpu_kernel.Norm(scale, config.rms_norm_eps, config.norm_unit_offset)


def packed_step_ops(w: StepWeights, config: ModelConfig, shards: int = 1) -> LayerOps:
    """`step_ops` over one layer of `PackedWeights`: its matrices through `packed_or_plain`, each pre-norm inside
    the matmul after it (the kernel normalizes and rounds its float32 rows: no norm, rsqrt and cast ops in XLA),
    and `act(gate) * up` in the AMX kernel's epilogue where `pack_step_weights` packed gate|up for it
    (`gated_in_kernel`)."""
    def gated(x: jax.Array, gate_up: jax.Array, scale: jax.Array | None = None) -> jax.Array:
        return cpu_kernel.packed_gated_matmul(x, gate_up, config.hidden_act, norm=kernel_norm(config, scale))

    return step_ops(w, config, shards, packed_or_plain(config), gated if gated_in_kernel(config) else None,
                    norms_in_matmul=True)


def kernel_decode_step(params: Params, weights: list[StepWeights] | PackedWeights, config: ModelConfig,
                       tokens: jax.Array, positions: jax.Array, page_table: jax.Array, pages: list[PagedLayer],
                       backend: str, shards: int = 1, rotary: Rotary | None = None
                       ) -> tuple[jax.Array, list[PagedLayer], jax.Array | None]:
    """One decode step of every slot straight over the pages (the kernels: GPU, TPU, CPU): `tokens [S]` at
    `positions [S]` (-1: an idle slot, which writes nothing and reads nothing) with page tables `[S, M]`. Returns
    float32 logits `[S, V]`, the pages with the tokens written and an MoE model's experts `[S, L, k]` (else None).
    With `PackedWeights` (the CPU, AMX) the matmuls
    run on the packed kernel. `rotary`: this step's tables (`step_rotary`), else computed here."""
    packed = weights if isinstance(weights, PackedWeights) else None
    layers = packed.layers if packed is not None else weights
    c = config
    num_pages, page_size = pool_geometry(pages)
    slots = page_slots(page_table, positions[:, None], page_size, num_pages)
    lengths = jnp.where(positions >= 0, positions + 1, 0)
    if rotary is None:  # the kernels mask by length: only the rotary tables are needed
        rotary = {local: (cos, sin) for local, (cos, sin, _) in layer_inputs(c, positions[:, None], 1).items()}

    def layer(i: int, w: StepWeights, paged: PagedLayer, _: None) -> LayerParts:
        window = c.sliding_window if c.is_sliding(i) else None
        ops = packed_step_ops(w, c, shards) if packed is not None else step_ops(w, c, shards)
        return LayerParts(ops, kernel_attention(c, paged, page_table, slots, lengths, backend, window),
                          *rotary[c.is_sliding(i)])

    out = run_layers(embed(params, c, tokens[:, None]), c, layer, layers, pages)
    experts = chosen_experts(out.routing)
    experts = None if experts is None else experts[:, 0]
    x = out.x[:, 0]
    if packed is not None:  # the final norm in the head's kernel
        return packed_logits(packed.head, c, x, params["final_norm"]["scale"]), out.states, experts
    return paged_logits(params, c, final_norm(params, c, x)), out.states, experts


def packed_logits(head: jax.Array, config: ModelConfig, hidden: jax.Array, scale: jax.Array | None = None
                  ) -> jax.Array:
    """float32 logits `[R, V]` of hidden states `[R, D]` through the AMX-packed LM head (`PackedWeights.head`),
    soft-capped where the model is. `scale`: the final norm's, applied in the kernel (`hidden` before it)."""
    logits = cpu_kernel.packed_matmul(hidden, head, config.vocab_size, norm=kernel_norm(config, scale))
    return softcap(logits, config.final_logit_softcap)


def paged_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits `[R, V]` of hidden states `[R, D]`."""
    return unembed(params, config, hidden).astype(jnp.float32)
