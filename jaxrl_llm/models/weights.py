"""The copies of a model's weights and their dtypes: the optimizer's float32 master, the working weights the
training forward computes with (`model.param_dtype`), and the inference copies the sampler, the evaluation and a
reference model keep (weight matrices in the compute dtype). Pure pytree maps; the precision policy of each matmul
is `jaxrl_llm.models.precision`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig


def cast_floating(params: Any, dtype: Any, *, copy: bool = False) -> Any:
    """Every floating leaf of `params` in `dtype` (other leaves as they are); a leaf already in `dtype` is returned
    itself, or a new buffer with `copy=True`."""

    def cast(p: jax.Array) -> jax.Array:
        if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != dtype:
            return p.astype(dtype)
        return jnp.copy(p) if copy else p

    return jax.tree.map(cast, params)


def master_weights(params: Any) -> Any:
    """The optimizer's copy of the weights: every floating leaf in float32 (a no-op for float32 params).

    Trainers keep this copy (and AdamW moments of its dtype) whatever `model.param_dtype` says: a bf16 weight
    near 0.05 moves in steps of 2^-12 ~ 2.4e-4, so updates of lr ~ 1e-6 would round away in bf16.
    """
    return cast_floating(params, jnp.float32)


def working_weights(params: Any, config: ModelConfig) -> Any:
    """The weights the model computes with: floating leaves cast to `config.param_dtype` (bf16 halves the bytes
    the forward reads); the gradient through the cast lands on the float32 master in float32."""
    return cast_floating(params, config.jnp_param_dtype)


MATRIX_NAMES = ("kernel", "embedding", "lora_a", "lora_b")  # the leaves `inference_copy` stores in bf16


def inference_copy(params: Any, config: ModelConfig) -> Any:
    """New buffers of `params` as the sampler, the evaluation and a reference model store them: every weight
    matrix (`MATRIX_NAMES`) in `config.jnp_inference_param_dtype`, bfloat16 under a bfloat16 compute dtype, so
    each decode step reads half the bytes; norm scales and biases as they are. The precision policy casts
    matrices to the compute dtype before use anyway, so this copy computes exactly what the float32 master
    computes."""
    dtype = config.jnp_inference_param_dtype

    def cast(path: tuple, p: jax.Array) -> jax.Array:
        name = getattr(path[-1], "key", None) if path else None
        if name in MATRIX_NAMES and jnp.issubdtype(p.dtype, jnp.floating) and p.dtype != dtype:
            return p.astype(dtype)
        return jnp.copy(p)

    return jax.tree_util.tree_map_with_path(cast, params)


def frozen_copy(params: Any, config: ModelConfig) -> Any:
    """A reference model's weights: an `inference_copy`, always new buffers (never the master's own, which the
    train step donates and overwrites)."""
    return inference_copy(params, config)
