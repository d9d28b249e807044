"""Flax decoder for pre-norm families (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 text, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss), switched by `ModelConfig`.

The forward pass is a pure function of `(params, tokens, positions, key_mask, cache, cache_index)`:

- `params` is a plain nested dict; the layers are stacked on a leading `[L, ...]` axis (one `nn.scan`), so a
  parameter path such as `layers/attn/q/kernel` has shape `[L, D, H * hd]`.
- The KV cache is an explicit pytree `{"k": [L, B, S, KVH, hd], "v": [L, B, S, KVH, hd]}` passed in and
  returned (no mutable collections): the same function trains on full sequences (`cache=None`) and decodes
  one token at a time (`T = 1` written at slot `cache_index`).
- Left-padded batches: `positions` come from the attention mask (`positions_from_mask`); `key_mask [B, S]`
  marks the valid key slots, so padded keys are never attended to. A query in slot `cache_index + t`
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

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm.models.attention import AttentionMask
from jaxrl_llm.models.block import LayerOps, cached_attention, layer_kinds_present, transformer_block
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import (
    embed_tokens,
    positions_from_mask,
    rope_cos_sin,
    softcap,
)
from jaxrl_llm.models.moe import NO_RECORD, Routing
from jaxrl_llm.models.options import REMAT_POLICIES
from jaxrl_llm.models.packing import PackedLayout, gather_predictors, model_inputs, packed_inputs
from jaxrl_llm.models.precision import WEIGHT_MATMUL, matmul_transposed
from jaxrl_llm.models.sequence_parallel import constrain_positions, pad_rows, padded_length
from jaxrl_llm.models.sublayers import MLP, Attention, MoE, make_dense, make_norm

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


class DecoderLayer(nn.Module):
    """One layer's weights (`attn_norm`, `attn`, `mlp_norm`, `mlp`: an `MLP` or, for an MoE family, an `MoE`, and
    Gemma 2/3's sandwich norms), run as `block.transformer_block` over the decoder's cache layout
    (`block.cached_attention`). `inputs`: `attention_inputs(...)`, of which the layer takes entry `kind` (an int:
    chosen while tracing; a scanned array: selected on the device)."""

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.attn_norm = make_norm(c, "attn_norm")
        self.attn = Attention(c, name="attn")
        self.mlp_norm = make_norm(c, "mlp_norm")
        self.mlp = MoE(c, name="mlp") if c.is_moe else MLP(c, name="mlp")
        if c.sandwich_norms:
            self.attn_post_norm = make_norm(c, "attn_post_norm")
            self.mlp_post_norm = make_norm(c, "mlp_post_norm")

    def ops(self, replay: jax.Array | None = None, valid: jax.Array | None = None) -> LayerOps:
        """The layer's weights as `LayerOps` (the Flax modules: LoRA factors and dropout included); `replay`,
        `valid`: see `MoE.feed_forward`."""
        c = self.config
        return LayerOps(
            attn_norm=self.attn_norm, qkv=self.attn.qkv,
            q_norm=self.attn.q_norm if c.qk_norm else None, k_norm=self.attn.k_norm if c.qk_norm else None,
            o=self.attn.o, attn_post_norm=self.attn_post_norm if c.sandwich_norms else None,
            mlp_norm=self.mlp_norm, feed_forward=self.mlp.feed_forward(replay, valid),
            mlp_post_norm=self.mlp_post_norm if c.sandwich_norms else None,
            sinks=self.attn.sinks if c.attention_sinks else None,
        )

    def __call__(self, x: jax.Array, layer_cache: Cache | None, inputs: tuple[AttentionInputs, ...],
                 cache_index: jax.Array | int, kind: jax.Array | int = 0, replay: jax.Array | None = None,
                 valid: jax.Array | None = None) -> tuple[jax.Array, tuple[Cache | None, Routing | None]]:
        cos, sin, mask = _select(inputs, kind)
        attend = cached_attention(self.config, mask, layer_cache, cache_index,
                                  _is_local(self.config, kind, len(inputs)))
        split = self.config.sequence_mesh if layer_cache is None else None
        x = constrain_positions(x, split)  # the scanned carry keeps its positions split (a no-op without a mesh)
        x, cache, routing = transformer_block(x, self.ops(replay, valid), attend, cos, sin, self.config)
        return constrain_positions(x, split), (cache, routing)


def remat_layer(config: ModelConfig) -> type[nn.Module]:
    """The scanned layer, rematerialised under `config.remat`: `full` keeps only each layer's input for the backward
    pass and recomputes the rest; `matmuls` also keeps the outputs of its weight matmuls (`precision.matmul`: q, k, v,
    o, gate, up, down, LoRA's) and recomputes the attention and the elementwise work between them."""
    if not config.remat:
        return DecoderLayer
    if config.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {', '.join(REMAT_POLICIES)}, not {config.remat_policy!r}")
    policy = (jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL) if config.remat_policy == "matmuls"
              else None)
    return nn.remat(DecoderLayer, prevent_cse=False, policy=policy)


class Decoder(nn.Module):
    """Causal LM: embed -> L x DecoderLayer (scanned) -> final RMSNorm -> unembed.

    `__call__(tokens [B, T], positions [B, T], key_mask [B, S], cache, cache_index)` returns
    `(logits [B, T, V], cache)`, or `(hidden [B, T, D], cache)` after the final norm with `return_hidden`.
    Without a cache, `S = T` and `key_mask` is the attention mask. MoE: `replay [L, B, T, k]` forces the experts
    (`moe.route`), `token_mask [B, T]` keeps padding out of the experts' dispatch, and `return_routing` appends
    every layer's `Routing` (`experts [L, B, T, k]`, `logits [L, B, T, E]`) to the result.

    With `config.sequence_mesh` (and no cache) the positions are split over its `sequence` axis: the rows are padded
    at their end to a multiple of its size (`sequence_parallel.pad_rows`), the activations constrained to
    `[B over the batch axes, T over sequence, D]` after the embedding and on every layer's carry, and the outputs
    sliced back to `T`.
    """

    config: ModelConfig

    def setup(self) -> None:
        c = self.config
        self.embed = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            dtype=c.jnp_activation_dtype,
            param_dtype=c.jnp_param_dtype,
            embedding_init=nn.initializers.normal(c.initializer_range),
        )
        layer = remat_layer(c)
        self.layers = nn.scan(
            layer,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(0, nn.broadcast, nn.broadcast, 0, 0, nn.broadcast),
            length=c.num_layers,
            unroll=c.scan_unroll,
        )(c)
        self.final_norm = make_norm(c, "final_norm")
        if not c.tie_word_embeddings:
            self.lm_head = make_dense(c, c.vocab_size, False, "lm_head", jnp.dtype(jnp.float32))  # logits: float32

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_mask: jax.Array,
        cache: Cache | None = None,
        cache_index: jax.Array | int = 0,
        return_hidden: bool = False,
        segments: jax.Array | None = None,
        replay: jax.Array | None = None,
        token_mask: jax.Array | None = None,
        return_routing: bool = False,
    ) -> tuple[jax.Array, Cache | None] | tuple[jax.Array, Cache | None, Routing | None]:
        c = self.config
        length = tokens.shape[1]
        split = c.sequence_mesh if cache is None else None
        if split is not None:  # whole shards: pad each row's end (no real query sees key mask 0 / segment 0)
            padded = padded_length(length, split)
            tokens, positions, key_mask, segments, token_mask = (
                pad_rows(a, padded) for a in (tokens, positions, key_mask, segments, token_mask))
            replay = pad_rows(replay, padded, axis=2, value=NO_RECORD)
        inputs = attention_inputs(c, positions, key_mask, tokens.shape[1], None if cache is None else cache_index,
                                  segments)
        x = constrain_positions(self.embed_tokens(tokens), split)
        x, (cache, routing) = self.layers(x, cache, inputs, cache_index, layer_kinds(c), replay, token_mask)
        x = self.final_norm(x)
        out = x if return_hidden else self.unembed(x)
        if split is not None and tokens.shape[1] != length:
            out = out[:, :length]
            routing = None if routing is None else jax.tree.map(lambda a: a[:, :, :length], routing)
        return (out, cache, routing) if return_routing else (out, cache)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings `[..., D]` (`layers.embed_tokens`)."""
        return embed_tokens(self.embed.embedding, tokens, self.config)

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """Logits `[..., V]` from final hidden states `[..., D]` (tied: `hidden @ embedding^T`), soft-capped
        for Gemma 2 (`final_logit_softcap`)."""
        c = self.config
        if c.tie_word_embeddings:
            logits = matmul_transposed(hidden, self.embed.embedding, c.jnp_dtype, jnp.float32)
            return softcap(logits, c.final_logit_softcap)
        return softcap(self.lm_head(hidden), c.final_logit_softcap)


def init_params(config: ModelConfig, key: jax.Array) -> Params:
    """Random parameters (normal with `initializer_range`, norms at 1), as transformers initialises."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Decoder(config).init(key, tokens, tokens, jnp.ones((1, 1), jnp.int32))["params"]


def param_shapes(config: ModelConfig) -> Params:
    """The parameter pytree of `config` as `jax.ShapeDtypeStruct`s, without allocating anything."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def init_cache(config: ModelConfig, batch: int, length: int) -> Cache:
    """Zero KV cache `{"k", "v": [L, batch, length, KVH, hd]}` in the compute dtype.

    Bytes: `2 * L * batch * length * KVH * hd * itemsize(dtype)`.
    """
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    return {"k": jnp.zeros(shape, config.jnp_dtype), "v": jnp.zeros(shape, config.jnp_dtype)}


def forward(params: Params, config: ModelConfig, tokens: jax.Array, attention_mask: jax.Array, *,
            return_hidden: bool = False, dropout_key: jax.Array | None = None) -> jax.Array:
    """Full-sequence forward of a left-padded batch: logits `[B, T, V]` (or final hidden `[B, T, D]`).
    `dropout_key`: the randomness of LoRA dropout (unmerged adapters in `params`; nothing else drops)."""
    return forward_routed(params, config, tokens, attention_mask, return_hidden=return_hidden,
                          dropout_key=dropout_key)[0]


def forward_routed(params: Params, config: ModelConfig, tokens: jax.Array, attention_mask: jax.Array, *,
                   replay: jax.Array | None = None, return_hidden: bool = False,
                   dropout_key: jax.Array | None = None) -> tuple[jax.Array, Routing | None]:
    """`forward` that also returns every MoE layer's `Routing` (`experts [L, B, T, k]`, `logits [L, B, T, E]`; None
    for a dense model) and replays `replay [L, B, T, k]` where given (`moe.route`)."""
    out, _, routing = Decoder(config).apply(
        {"params": params},
        tokens,
        positions_from_mask(attention_mask),
        attention_mask,
        return_hidden=return_hidden,
        replay=replay,
        token_mask=attention_mask,
        return_routing=True,
        rngs=None if dropout_key is None else {"dropout": dropout_key},
    )
    return out, routing


def forward_packed(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   segments: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
    """Final hidden states `[R, S, D]` of packed rows (`tokens, positions, segments [R, S]`, see
    `jaxrl_llm.models.packing`): attention never crosses a segment, positions restart per sequence."""
    return forward_packed_routed(params, config, tokens, positions, segments, dropout_key=dropout_key)[0]


def forward_packed_routed(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
                          segments: jax.Array, *, replay: jax.Array | None = None,
                          dropout_key: jax.Array | None = None) -> tuple[jax.Array, Routing | None]:
    """`forward_packed` that also returns every MoE layer's `Routing` over the rows (`[L, R, S, ...]`) and replays
    `replay [L, R, S, k]` where given."""
    out, _, routing = Decoder(config).apply(
        {"params": params}, tokens, positions, segments > 0, return_hidden=True, segments=segments, replay=replay,
        token_mask=segments > 0, return_routing=True, rngs=None if dropout_key is None else {"dropout": dropout_key},
    )
    return out, routing


class RoutedHidden(NamedTuple):
    """`completion_hidden_routed`'s result: the predicting hidden states `[N, T, D]`, every MoE layer's `Routing`
    over the positions the forward ran on (`[L, B, S, ...]`: the padded `[N, P + T - 1]` or the packed `[R, S]`),
    and those positions' mask `[B, S]` (1 = a real token)."""

    hidden: jax.Array
    routing: Routing | None
    token_mask: jax.Array


def completion_hidden(params: Params, config: ModelConfig, prompt_tokens: jax.Array, prompt_mask: jax.Array,
                      completion_tokens: jax.Array, completion_mask: jax.Array, *, layout: PackedLayout | None = None,
                      dropout_key: jax.Array | None = None) -> jax.Array:
    """The final hidden states that predict each completion token, `[N, T, D]`: one forward pass over
    `prompt + completion[:-1]` (left-padded prompts `[N, P]`, right-padded completions `[N, T]`), the state at
    position `P - 1 + t` predicting `y_t`. With a packed `layout` (`jaxrl_llm.models.packing`) the pass runs on its
    rows, no padding computed, and the same states are gathered back to `[N, T, D]`."""
    return completion_hidden_routed(params, config, prompt_tokens, prompt_mask, completion_tokens, completion_mask,
                                    layout=layout, dropout_key=dropout_key).hidden


def completion_hidden_routed(params: Params, config: ModelConfig, prompt_tokens: jax.Array, prompt_mask: jax.Array,
                             completion_tokens: jax.Array, completion_mask: jax.Array, *,
                             layout: PackedLayout | None = None, dropout_key: jax.Array | None = None,
                             replay: jax.Array | None = None) -> RoutedHidden:
    """`completion_hidden` with the routing of an MoE model (`RoutedHidden`). `replay [N, P + T, L, k]`: the experts
    each token of `prompt + completion` was routed to where it was recorded (`moe.NO_RECORD` where not), replayed on
    the forward's inputs (the last completion token is no input; packed rows get their tokens' records)."""
    p = prompt_tokens.shape[1]
    tokens, mask = model_inputs(prompt_tokens, completion_tokens), model_inputs(prompt_mask, completion_mask)
    forced = None if replay is None else replay[:, :-1].astype(jnp.int32)  # [N, S, L, k]
    if layout is None:
        if forced is not None:
            forced = jnp.moveaxis(forced, 2, 0)  # [L, N, S, k]
        hidden, routing = forward_routed(params, config, tokens, mask, return_hidden=True, replay=forced,
                                         dropout_key=dropout_key)
        return RoutedHidden(hidden[:, p - 1 :], routing, mask)
    rows, positions, segments = packed_inputs(tokens, mask, layout)
    if forced is not None:
        pad = layout.source < 0
        flat = forced.reshape(-1, *forced.shape[2:])[jnp.where(pad, 0, layout.source)]  # [R, S, L, k]
        forced = jnp.moveaxis(jnp.where(pad[..., None, None], NO_RECORD, flat), 2, 0)
    hidden, routing = forward_packed_routed(params, config, rows, positions, segments, replay=forced,
                                            dropout_key=dropout_key)
    return RoutedHidden(gather_predictors(hidden, layout), routing, segments > 0)


def unembed(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Logits from final hidden states with the model's (possibly tied) output matrix."""
    return Decoder(config).apply({"params": params}, hidden, method=Decoder.unembed)


def unembedding_as_stored(params: Params, config: ModelConfig) -> tuple[jax.Array, bool]:
    """`(W, transposed)`: the LM head's kernel `[D, V]` (False), or the tied embedding `[V, D]` itself (True), for
    `logits = hidden @ W` or `hidden @ W^T` without a transposed view for XLA to fold into the dot."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"], True
    return params["lm_head"]["kernel"], False


def decode_step(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    key_mask: jax.Array,
    cache: Cache,
    cache_index: jax.Array | int,
) -> tuple[jax.Array, Cache]:
    """Run `tokens [B, T]` at cache slots `cache_index ... cache_index + T - 1`.

    `key_mask [B, S]` must already mark the new slots valid. Returns `(logits [B, T, V], cache)`.
    Prefill is `decode_step` with the whole prompt at `cache_index = 0`.
    """
    logits, cache = Decoder(config).apply(
        {"params": params}, tokens, positions, key_mask, cache, cache_index
    )
    return logits, cache
