"""Scalar heads on the decoder's final hidden states: the PPO critic (a value per token).

A head is a plain pytree `{"kernel": [D, 1], "bias": [1]}` (float32), applied as `hidden @ kernel + bias`.
A critic is `{"decoder": decoder params, "value_head": head}`: a full decoder of its own (initialised from
the policy or from another model directory, e.g. a reward model) plus the head, so it shares no weights
with the policy and is trained by its own optimizer.

`load_critic(dir)` starts a critic from a Hugging Face reward model (`...ForSequenceClassification`: the
decoder and the first row of its `score.weight` as the head, bias 0; see `models/reward_model.py`) or from a
causal LM directory (its decoder and a zero head).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, completion_hidden
from jaxrl_llm.models.hf import is_classifier, load_hf_model, resolve_model_dir  # hf imports the decoder
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.precision import matmul
from jaxrl_llm.models.reward_model import load_hf_reward_model
from jaxrl_llm.models.sequences import Sequences

ScalarHead = dict[str, jax.Array]
CriticParams = dict[str, Any]  # {"decoder": Params, "value_head": ScalarHead}


def init_scalar_head(hidden_size: int, key: jax.Array | None = None, *, stddev: float = 0.0) -> ScalarHead:
    """A head `{"kernel": [D, 1], "bias": [1]}` float32: all zeros (`key=None` or `stddev=0`, so every value
    starts at 0) or a kernel drawn from `N(0, stddev^2)` with a zero bias."""
    kernel = jnp.zeros((hidden_size, 1), jnp.float32)
    if key is not None and stddev > 0:
        kernel = stddev * jax.random.normal(key, (hidden_size, 1), jnp.float32)
    return {"kernel": kernel, "bias": jnp.zeros((1,), jnp.float32)}


def apply_scalar_head(head: ScalarHead, hidden: jax.Array, compute_dtype: jnp.dtype | str = jnp.float32) -> jax.Array:
    """`hidden [..., D] @ kernel [D, 1] + bias` -> `[...]` float32, a `precision.matmul` in `compute_dtype`."""
    out = matmul(hidden, head["kernel"], compute_dtype, jnp.float32) + head["bias"].astype(jnp.float32)
    return out[..., 0]


def critic_values(
    critic: CriticParams,
    config: ModelConfig,
    sequences: Sequences,
    layout: PackedLayout | None = None,
) -> jax.Array:
    """Per-token values `V_t = V(x, y_<t)` `[N, T]` float32: the value of the state *before* completion token t.

    The final hidden state that predicts `y_t` (`decoder.completion_hidden`, the same states as the policy's
    log-probs; packed rows with a `layout`), mapped to a scalar by the head. `sequences`: prompts `[N, P]`
    (left-padded), completions `[N, T]`. Values at padded completion positions are computed
    but meaningless; every consumer masks them.
    """
    hidden = completion_hidden(critic["decoder"], config, sequences, layout=layout).hidden
    return apply_scalar_head(critic["value_head"], hidden, config.jnp_dtype)


def critic_from_policy(policy_params: Params, config: ModelConfig) -> CriticParams:
    """A critic whose decoder is a copy of the policy's and whose head is zero (every `V_t = 0` at start)."""
    return {"decoder": jax.tree.map(jnp.copy, policy_params), "value_head": init_scalar_head(config.hidden_size)}


def load_critic(model_dir: str | os.PathLike[str], **config_overrides: Any) -> tuple[ModelConfig, CriticParams]:
    """A critic from a model directory (or hub id): `(ModelConfig, {"decoder", "value_head"})`.

    - a reward model (`...ForSequenceClassification`): its decoder, and `kernel = score.weight[0]^T [D, 1]`,
      `bias = 0`, so at the start `V(x, y_<t)` is the reward model's score of the prefix `x, y_<t`;
    - a causal LM: its decoder and a zero head (every value 0 at the start).
    """

    path = resolve_model_dir(model_dir)
    if is_classifier(path):
        config, decoder, score_kernel = load_hf_reward_model(path, **config_overrides)
        head = {"kernel": jnp.asarray(score_kernel[:, :1], jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}
    else:
        config, decoder = load_hf_model(path, **config_overrides)
        head = init_scalar_head(config.hidden_size)
    return config, {"decoder": decoder, "value_head": head}
