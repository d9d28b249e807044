"""Flax decoder for pre-norm families (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 text, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss), switched by `ModelConfig`.

The forward pass is a pure function of `(params, tokens, positions, key_mask)` (`decoder_hidden`):

- `params` is a plain nested dict; the layers are stacked on a leading `[L, ...]` axis, so a parameter path such as
  `layers/attn/q/kernel` has shape `[L, D, H * hd]`. The layer stack is run by `stack.run_layers` (scanned here: one
  layer compiled), the one driver every path shares: the samplers run the same layers unrolled over their caches
  (`flax_layer` with a cache for the static sampler's prefill, `decode.py`, `engine/model.py`).
- Left-padded batches: `positions` come from the attention mask (`positions_from_mask`); `key_mask [B, S]`
  marks the valid key slots, so padded keys are never attended to. With a cache, a query in slot `cache_index + t`
  attends to key slots `s <= cache_index + t` with `key_mask[b, s] = 1` (and, with a sliding window `W`,
  `cache_index + t - s < W`: within a left-padded row, slot distance equals position distance).

RoPE uses the Hugging Face `rotate_half` convention (the two halves of each head are the pair), with
`rope_scaling` types `linear`, `llama3`, `yarn` and `longrope`.

A layer's weights are the Flax modules of `models/sublayers.py` (norms, dense projections with unmerged LoRA, the
attention's, the gated MLP, the MoE). An MoE layer's feed-forward (`MoE`) routes each token to its top-k experts
(`models/moe.py`); the forward can return every layer's `Routing` (`return_routing`) and take a recorded selection to
replay (`replay [L, B, T, k]`).

Attention reads its mask as structure (`models/attention.py`): segment ids (packed rows), or the key mask with
every query in one segment (left-padded rows, a cache), and the cache index as the queries' offset; no `[B, T, S]`
mask is built. Families whose layers differ (Gemma 2/3: sliding-window layers between global ones, Gemma 3's local
RoPE base) keep the one scanned layer stack: the decoder builds both rotary tables, and each layer picks its own
tables and window with a scanned per-layer flag (`AttentionInputs`, `block.cached_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm.models.attention import AttentionMask
from jaxrl_llm.models.block import LayerOps, cached_attention, layer_kinds_present, transformer_block
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.gated_delta import LinearState
from jaxrl_llm.models.layers import (
    embed_tokens,
    positions_from_mask,
    rms_norm,
    rope_cos_sin,
    softcap,
)
from jaxrl_llm.models.moe import NO_RECORD, Routing
from jaxrl_llm.models.options import REMAT_POLICIES
from jaxrl_llm.models.packing import PackedLayout, gather_predictors, packed_inputs
from jaxrl_llm.models.precision import WEIGHT_MATMUL, matmul_transposed
from jaxrl_llm.models.sequence_parallel import constrain_positions, pad_rows, padded_length
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.models.stack import LayerFn, LayerParts, merge_kinds, run_layers
from jaxrl_llm.models.sublayers import MLP, Attention, LinearAttention, MoE, make_dense, make_norm

Params = dict[str, Any]
Cache = dict[str, jax.Array]


class AttentionInputs(NamedTuple):
    """What one layer kind's attention reads: rotary tables `cos, sin [B, T, rot]` and the mask's structure (the same
    for every kind; the window is the kind's, `block.attention_spec`)."""

    cos: jax.Array
    sin: jax.Array
    mask: AttentionMask


def _kinds(config: ModelConfig) -> list[bool]:
    """The layer kinds present (False: full attention, True: sliding window), in `attention_inputs`' order."""
    return layer_kinds_present(config)


def attention_kind(config: ModelConfig, layer: int) -> int:
    """Layer `layer`'s index into `attention_inputs(...)` (0 for every layer when the layers are alike)."""
    return _kinds(config).index(config.is_sliding(layer))


def attention_inputs(
    config: ModelConfig, positions: jax.Array, key_mask: jax.Array, num_queries: int,
    cache_index: jax.Array | int | None, segments: jax.Array | None = None,
) -> tuple[AttentionInputs, ...]:
    """The rotary tables and mask the layers need: one `AttentionInputs` when every layer is alike, else
    `(global, local)` (index with `attention_kind`). With `segments` (packed rows, no cache) the mask is their
    segment ids (block-diagonal causal, `AttentionMask.packed`) and `key_mask` is unused; else `key_mask [B, S]`
    with the queries at `cache_index` (None: no cache, the queries are the keys; `AttentionMask.padded`)."""
    mask = (AttentionMask.padded(key_mask, num_queries, cache_index) if segments is None
            else AttentionMask.packed(segments))
    return tuple(AttentionInputs(*rope_cos_sin(config, positions, local=local), mask) for local in _kinds(config))


def layer_kinds(config: ModelConfig) -> jax.Array:
    """`[L]` int32: `attention_kind` of every layer (scanned along the layer stack)."""
    return jnp.asarray([attention_kind(config, i) for i in range(config.num_layers)], jnp.int32)


def _select(inputs: tuple[AttentionInputs, ...], kind: jax.Array | int) -> AttentionInputs:
    """Layer kind `kind`'s inputs: by index when it is known while tracing, else the rotary tables selected by the
    scanned flag (the mask is shared)."""
    if len(inputs) == 1 or isinstance(kind, int):
        return inputs[kind if len(inputs) > 1 else 0]  # type: ignore[index]
    full, local = inputs
    return AttentionInputs(jnp.where(kind == 1, local.cos, full.cos), jnp.where(kind == 1, local.sin, full.sin),
                           full.mask)


def _is_local(config: ModelConfig, kind: jax.Array | int, kinds: int) -> bool | jax.Array:
    """Whether layer kind `kind` (an index into `_kinds`) has a sliding window: static where the kind is (one kind,
    or an int), else the scanned flag as a traced bool."""
    present = _kinds(config)
    if kinds == 1:
        return present[0]
    if isinstance(kind, int):
        return present[kind]
    return kind == 1


class LinearInputs(NamedTuple):
    """What a linear-attention layer's mixer reads besides its input: its carried `LinearState` (None: sequences
    that start here) and the tokens' `segments [B, T]` (0: padding; None: one sequence per row)."""

    state: LinearState | None
    segments: jax.Array | None


class DecoderLayer(nn.Module):
    """One layer's weights (`attn_norm`, `attn`, or for a linear-attention layer (`linear`) `linear_attn`, `mlp_norm`,
    `mlp`: an `MLP` or, for an MoE family, an `MoE`, and Gemma 2/3's sandwich norms) as `block.LayerOps` (`ops`),
    which the layer stack runs (`stack.run_layers` through `flax_layer`). `__call__` runs the block once, without a
    cache (`(x, None)`, a scan body's form): what `DecoderWeights` creates the weights with."""

    config: ModelConfig
    linear: bool = False

    def setup(self) -> None:
        c = self.config
        self.attn_norm = make_norm(c, "attn_norm")
        if self.linear:
            self.linear_attn = LinearAttention(c, name="linear_attn")
        else:
            self.attn = Attention(c, name="attn")
        self.mlp_norm = make_norm(c, "mlp_norm")
        self.mlp = MoE(c, name="mlp") if c.is_moe else MLP(c, name="mlp")
        if c.sandwich_norms:
            self.attn_post_norm = make_norm(c, "attn_post_norm")
            self.mlp_post_norm = make_norm(c, "mlp_post_norm")

    def ops(self, replay: jax.Array | None = None, valid: jax.Array | None = None,
            linear: LinearInputs | None = None) -> LayerOps:
        """The layer's weights as `LayerOps` (the Flax modules: LoRA factors and dropout included); `replay`,
        `valid`: see `MoE.feed_forward`; `linear`: a linear-attention layer's state and segments."""
        c = self.config
        common = dict(attn_norm=self.attn_norm, mlp_norm=self.mlp_norm,
                      feed_forward=self.mlp.feed_forward(replay, valid),
                      attn_post_norm=self.attn_post_norm if c.sandwich_norms else None,
                      mlp_post_norm=self.mlp_post_norm if c.sandwich_norms else None)
        if self.linear:
            state, segments = linear or LinearInputs(None, None)
            return LayerOps(qkv=None, q_norm=None, k_norm=None, o=None,
                            mixer=self.linear_attn.mixer(state, segments), **common)
        return LayerOps(
            qkv=self.attn.qkv, q_norm=self.attn.q_norm if c.qk_norm else None,
            k_norm=self.attn.k_norm if c.qk_norm else None, o=self.attn.o,
            sinks=self.attn.sinks if c.attention_sinks else None, **common)

    def __call__(self, x: jax.Array, inputs: tuple[AttentionInputs, ...]) -> tuple[jax.Array, None]:
        cos, sin, mask = inputs[0]
        return transformer_block(x, self.ops(), cached_attention(self.config, mask), cos, sin, self.config)[0], None


class DecoderWeights(nn.Module):
    """The model's weights: the token embedding, the layers (`DecoderLayer`, stacked `[L, ...]` by `nn.scan`, one
    random key per layer), the final norm and the LM head (absent when tied to the embedding). `__call__` runs them
    once, to create the weights (`init_params`); the forward is `decoder_hidden` (the layers through
    `stack.run_layers`), which reads the ends through `embed_tokens`, `normed` and `unembed`."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.jnp_activation_dtype, param_dtype=c.jnp_param_dtype,
                              embedding_init=nn.initializers.normal(c.initializer_range))
        # The weights do not depend on how attention runs: the layers' one run (`__call__`) is XLA's, on one device.
        # A hybrid stack's two kinds are created as two stacks (`init_params` merges them into one `layers`).
        one = c.replace(sequence_mesh=None, attention="xla")
        self.layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=nn.broadcast, length=len(c.layers_holding("attn")))(one)
        if c.is_hybrid:
            self.linear_layers = nn.scan(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                                         in_axes=nn.broadcast, length=len(c.layers_holding("linear_attn")))(one, True)
        self.final_norm = make_norm(c, "final_norm")
        if not c.tie_word_embeddings:
            self.lm_head = make_dense(c, c.vocab_size, False, "lm_head", jnp.dtype(jnp.float32))  # logits: float32

    def __call__(self, tokens: jax.Array) -> jax.Array:
        inputs = attention_inputs(self.config, jnp.zeros_like(tokens), jnp.ones_like(tokens), tokens.shape[1], None)[:1]
        x, _ = self.layers(self.embed_tokens(tokens), inputs)
        if self.config.is_hybrid:
            x, _ = self.linear_layers(x, inputs)
        return self.unembed(self.final_norm(x))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings `[..., D]` (`layers.embed_tokens`)."""
        return embed_tokens(self.embed.embedding, tokens, self.config)

    def normed(self, hidden: jax.Array) -> jax.Array:
        """The final norm of the last layer's output."""
        return self.final_norm(hidden)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """Logits `[..., V]` from final hidden states `[..., D]` (tied: `hidden @ embedding^T`), soft-capped
        for Gemma 2 (`final_logit_softcap`)."""
        c = self.config
        if c.tie_word_embeddings:
            logits = matmul_transposed(hidden, self.embed.embedding, c.jnp_dtype, jnp.float32)
            return softcap(logits, c.final_logit_softcap)
        return softcap(self.lm_head(hidden), c.final_logit_softcap)


def _ends(params: Params, config: ModelConfig) -> DecoderWeights:
    """The model's weights bound to `params`, for its ends (the embedding, the final norm, the head)."""
    return DecoderWeights(config).bind({"params": params})


def layer_checkpoint(config: ModelConfig) -> Callable[[Callable], Callable] | None:
    """The scanned layer step's rematerialisation under `config.remat` (None: off): `full` keeps only each layer's
    input for the backward pass and recomputes the rest; `matmuls` also keeps the outputs of its weight matmuls
    (`precision.matmul`: q, k, v, o, gate, up, down, LoRA's) and recomputes the attention and the elementwise work
    between them."""
    if not config.remat:
        return None
    if config.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {', '.join(REMAT_POLICIES)}, not {config.remat_policy!r}")
    policy = (jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL) if config.remat_policy == "matmuls"
              else None)
    return lambda step: jax.checkpoint(step, prevent_cse=False, policy=policy)


class LayerExtras(NamedTuple):
    """The training layer's per-layer inputs (`stack.run_layers`' `per_layer`): an MoE model's forced experts
    `replay [B, T, k]` and the layer's LoRA-dropout key (each None where absent)."""

    replay: jax.Array | None
    dropout_key: jax.Array | None


def flax_layer(config: ModelConfig, inputs: tuple[AttentionInputs, ...], cache_index: jax.Array | int = 0,
               token_mask: jax.Array | None = None, segments: jax.Array | None = None) -> LayerFn:
    """The layer part of the Flax modules (`DecoderLayer`, LoRA and dropout included) over the decoder's cache layout
    (`block.cached_attention`; no state: a full sequence): the training forward and the static sampler's prefill.
    `inputs`: `attention_inputs(...)`; a layer takes entry `attention_kind` (an int index: chosen while tracing; a
    traced one: selected on the device). `token_mask [B, T]` keeps padding out of an MoE's dispatch. A
    linear-attention layer (its weights hold `linear_attn`) carries a `LinearState` as its cache and reads the new
    tokens' `segments [B, T]` (0: padding)."""
    kinds = layer_kinds(config)

    def layer(i: Any, weights: Params, cache: Any, extra: LayerExtras | None) -> LayerParts:
        replay, key = (None, None) if extra is None else extra
        linear = "linear_attn" in weights
        module = DecoderLayer(config, linear).bind({"params": weights},
                                                   rngs=None if key is None else {"dropout": key})
        if linear:
            ops = module.ops(replay, token_mask, LinearInputs(cache, segments))
            return LayerParts(ops, None, None, None)  # type: ignore[arg-type]
        kind = attention_kind(config, i) if isinstance(i, int) else kinds[i]
        cos, sin, mask = _select(inputs, kind)
        attend = cached_attention(config, mask, cache, cache_index, _is_local(config, kind, len(inputs)))
        return LayerParts(module.ops(replay, token_mask), attend, cos, sin)

    return layer


def decoder_hidden(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array, key_mask: jax.Array,
                   *, segments: jax.Array | None = None, replay: jax.Array | None = None,
                   token_mask: jax.Array | None = None, dropout_key: jax.Array | None = None
                   ) -> tuple[jax.Array, Routing | None]:
    """The full-sequence forward: embed -> the scanned layer stack (`stack.run_layers`) -> final norm, returning the
    final hidden states `[B, T, D]` and every MoE layer's `Routing` (`experts [L, B, T, k]`, `logits [L, B, T, E]`;
    None for a dense model). `key_mask [B, T]` the attention mask, or `segments [B, T]` (packed rows); `replay
    [L, B, T, k]` forces the experts (`moe.route`); `token_mask [B, T]` keeps padding out of the experts' dispatch;
    `dropout_key`: LoRA dropout's randomness (a key per layer).

    With `config.sequence_mesh` the positions are split over its `sequence` axis: the rows are padded at their end to
    a multiple of its size (`sequence_parallel.pad_rows`), the activations constrained to `[B over the batch axes,
    T over sequence, D]` after the embedding and between layers, and the outputs sliced back to `T`."""
    c = config
    length = tokens.shape[1]
    split = c.sequence_mesh
    if split is not None:  # whole shards: pad each row's end (no real query sees key mask 0 / segment 0)
        padded = padded_length(length, split)
        tokens, positions, key_mask, segments, token_mask = (
            pad_rows(a, padded) for a in (tokens, positions, key_mask, segments, token_mask))
        replay = pad_rows(replay, padded, axis=2, value=NO_RECORD)
    if split is not None and c.is_hybrid:
        raise ValueError("the sequence axis (mesh.sequence > 1) does not support linear-attention layers yet: "
                         "their state would have to pass from shard to shard; set mesh.sequence: 1")
    inputs = attention_inputs(c, positions, key_mask, tokens.shape[1], None, segments)
    ends = _ends(params, c)
    keys = None if dropout_key is None else jax.random.split(dropout_key, c.num_layers)
    extras = None if replay is None and keys is None else LayerExtras(replay, keys)
    x = constrain_positions(ends.embed_tokens(tokens), split)
    sequences = segments if segments is not None else key_mask.astype(jnp.int32)
    out = run_layers(x, c, flax_layer(c, inputs, token_mask=token_mask, segments=sequences), params["layers"],
                     per_layer=extras,
                     scanned=True, carry=lambda a: constrain_positions(a, split), checkpoint=layer_checkpoint(c))
    hidden, routing = ends.normed(out.x), out.routing
    if split is not None and tokens.shape[1] != length:
        hidden = hidden[:, :length]
        routing = None if routing is None else jax.tree.map(lambda a: a[:, :, :length], routing)
    return hidden, routing


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (normal with `initializer_range`, norms at 1), as transformers initialises
    (`DecoderWeights`: each layer's weights stacked on `[L, ...]`)."""
    params = DecoderWeights(config).init(key, jnp.zeros((1, 1), jnp.int32))["params"]
    if not config.is_hybrid:
        return params
    return {**{k: v for k, v in params.items() if k != "linear_layers"},
            "layers": merge_kinds(config, params["layers"], params["linear_layers"])}


def param_shapes(config: ModelConfig) -> Params:
    """The parameter pytree of `config` as `jax.ShapeDtypeStruct`s, without allocating anything."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def forward(params: Params, config: ModelConfig, tokens: jax.Array, attention_mask: jax.Array, *,
            replay: jax.Array | None = None, return_hidden: bool = False, return_routing: bool = False,
            dropout_key: jax.Array | None = None) -> jax.Array | tuple[jax.Array, Routing | None]:
    """Full-sequence forward of a left-padded batch: logits `[B, T, V]` (or final hidden `[B, T, D]`).
    `dropout_key`: the randomness of LoRA dropout (unmerged adapters in `params`; nothing else drops). MoE:
    `replay [L, B, T, k]` forces the experts where given (`moe.route`), and with `return_routing` the result is
    `(out, Routing)` (`experts [L, B, T, k]`, `logits [L, B, T, E]`; None for a dense model)."""
    hidden, routing = decoder_hidden(params, config, tokens, positions_from_mask(attention_mask), attention_mask,
                                     replay=replay, token_mask=attention_mask, dropout_key=dropout_key)
    out = hidden if return_hidden else unembed(params, config, hidden)
    return (out, routing) if return_routing else out


def forward_packed(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   segments: jax.Array, *, replay: jax.Array | None = None, return_routing: bool = False,
                   dropout_key: jax.Array | None = None) -> jax.Array | tuple[jax.Array, Routing | None]:
    """Final hidden states `[R, S, D]` of packed rows (`tokens, positions, segments [R, S]`, see
    `jaxrl_llm.models.packing`): attention never crosses a segment, positions restart per sequence. `replay
    [L, R, S, k]`, `return_routing`: as `forward`'s, over the rows."""
    hidden, routing = decoder_hidden(params, config, tokens, positions, segments > 0, segments=segments, replay=replay,
                                     token_mask=segments > 0, dropout_key=dropout_key)
    return (hidden, routing) if return_routing else hidden


class RoutedHidden(NamedTuple):
    """`completion_hidden`'s result: the predicting hidden states `[N, T, D]`, every MoE layer's `Routing` over the
    positions the forward ran on (`[L, B, S, ...]`: the padded `[N, P + T - 1]` or the packed `[R, S]`; None for a
    dense model), and those positions' mask `[B, S]` (1 = a real token)."""

    hidden: jax.Array
    routing: Routing | None
    token_mask: jax.Array


def completion_hidden(params: Params, config: ModelConfig, sequences: Sequences, *, layout: PackedLayout | None = None,
                      dropout_key: jax.Array | None = None, replay: jax.Array | None = None) -> RoutedHidden:
    """The final hidden states that predict each completion token, `[N, T, D]` (`RoutedHidden`, with an MoE model's
    routing): one forward pass over `sequences.inputs()` (`prompt + completion[:-1]`: left-padded prompts `[N, P]`,
    right-padded completions `[N, T]`), the state at position `P - 1 + t` predicting `y_t`. With a packed `layout`
    (`jaxrl_llm.models.packing`) the pass runs on its rows, no padding computed, and the same states are gathered back
    to `[N, T, D]`. `replay [N, P + T, L, k]`: the experts each token of `prompt + completion` was routed to where it
    was recorded (`moe.NO_RECORD` where not), replayed on the forward's inputs (the last completion token is no input;
    packed rows get their tokens' records)."""
    p = sequences.prompt_width
    tokens, mask = sequences.inputs()
    forced = None if replay is None else replay[:, :-1].astype(jnp.int32)  # [N, S, L, k]
    if layout is None:
        if forced is not None:
            forced = jnp.moveaxis(forced, 2, 0)  # [L, N, S, k]
        hidden, routing = forward(params, config, tokens, mask, return_hidden=True, replay=forced,
                                  return_routing=True, dropout_key=dropout_key)
        return RoutedHidden(hidden[:, p - 1 :], routing, mask)
    rows, positions, segments = packed_inputs(tokens, mask, layout)
    if forced is not None:
        pad = layout.source < 0
        flat = forced.reshape(-1, *forced.shape[2:])[jnp.where(pad, 0, layout.source)]  # [R, S, L, k]
        forced = jnp.moveaxis(jnp.where(pad[..., None, None], NO_RECORD, flat), 2, 0)
    hidden, routing = forward_packed(params, config, rows, positions, segments, replay=forced, return_routing=True,
                                     dropout_key=dropout_key)
    return RoutedHidden(gather_predictors(hidden, layout), routing, segments > 0)


def embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embeddings `[..., D]` in the activation dtype (Gemma's scaled by `sqrt(D)`)."""
    return embed_tokens(params["embed"]["embedding"], tokens, config)


def final_norm(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """The final norm of the last layer's output `x [..., D]`."""
    return rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps, unit_offset=config.norm_unit_offset)


def unembed(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits from final hidden states with the model's (possibly tied) output matrix."""
    return _ends(params, config).unembed(hidden)


def unembedding_as_stored(params: Params, config: ModelConfig) -> tuple[jax.Array, bool]:
    """`(W, transposed)`: the LM head's kernel `[D, V]` (False), or the tied embedding `[V, D]` itself (True), for
    `logits = hidden @ W` or `hidden @ W^T` without a transposed view for XLA to fold into the dot."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"], True
    return params["lm_head"]["kernel"], False
