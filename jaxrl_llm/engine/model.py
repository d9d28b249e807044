"""The decoder over a paged KV cache: the model's block (`models/block.py`) on the sampler's prepared weights
(`models/decode.py: step_ops`), its attention reading and writing pages (`pages.py`).

`paged_forward` runs `T` tokens per row at explicit positions (`-1` = padding: neither written nor attended
from), writes their keys and values into the rows' pages and attends over each row's pages: one function for a
prefill chunk (`T` = the chunk) and a decode step (`T = 1`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.engine.pages import PagedLayer, context_allowed, gather_pages, page_slots, write_pages
from jaxrl_llm.models.block import Attend, transformer_block
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import StepWeights, longrope_original, step_ops
from jaxrl_llm.models.decoder import Params, unembed
from jaxrl_llm.models.layers import embed_tokens, grouped_query_attention, rms_norm, rope_cos_sin


def check_engine_model(config: ModelConfig) -> None:
    """The engine computes RoPE per row; longrope switches its factors per batch (transformers' dynamic update),
    which a per-row engine cannot reproduce: such a model samples with the static sampler."""
    if longrope_original(config) is not None:
        raise ValueError("the rollout engine does not run longrope models (Phi-3.5 style); use "
                         "rollout.engine=static")


def paged_attention(config: ModelConfig, layer: PagedLayer, page_table: jax.Array, slots: jax.Array,
                    allowed: jax.Array) -> Attend:
    """Grouped-query attention over pages: the new keys and values written at `slots [R, T]`, then each row's
    queries attend to its gathered context `[R, M * page_size]` under `allowed [R, T, M * page_size]`."""
    c = config

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, PagedLayer]:
        new = write_pages(layer, slots, k, v)
        keys, values = gather_pages(new, page_table)
        out = grouped_query_attention(q, keys, values, allowed, scale=c.attention_scale,
                                      logit_softcap=c.attn_logit_softcap, compute_dtype=c.jnp_dtype)
        return out, new

    return attend


def paged_forward(params: Params, weights: list[StepWeights], config: ModelConfig, tokens: jax.Array,
                  positions: jax.Array, page_table: jax.Array, pages: list[PagedLayer]
                  ) -> tuple[jax.Array, list[PagedLayer]]:
    """`tokens, positions [R, T]` through the decoder over `pages` with page tables `[R, M]`: returns the final
    hidden states `[R, T, D]` (after the final norm) and the pages with the tokens' keys and values written."""
    c = config
    num_pages, page_size = pages[0]["k"].shape[:2]
    context = page_table.shape[1] * page_size
    slots = page_slots(page_table, positions, page_size, num_pages)
    kinds = sorted({c.is_sliding(i) for i in range(c.num_layers)})
    clamped = jnp.maximum(positions, 0)
    inputs = {local: (*rope_cos_sin(c, clamped, local=local),
                      context_allowed(positions, context, c.sliding_window if local else None))
              for local in kinds}
    x = embed_tokens(params["embed"]["embedding"], tokens, c)
    new_pages = []
    for i, (w, layer) in enumerate(zip(weights, pages, strict=True)):
        cos, sin, allowed = inputs[c.is_sliding(i)]
        x, layer = transformer_block(x, step_ops(w, c), paged_attention(c, layer, page_table, slots, allowed),
                                     cos, sin, c)
        new_pages.append(layer)
    return rms_norm(x, params["final_norm"]["scale"], c.rms_norm_eps, unit_offset=c.norm_unit_offset), new_pages


def paged_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits `[R, V]` of hidden states `[R, D]`."""
    return unembed(params, config, hidden).astype(jnp.float32)
