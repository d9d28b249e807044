"""Reward models: a Hugging Face sequence classifier (`LlamaForSequenceClassification`,
`Qwen2ForSequenceClassification`, ...) as the decoder plus its linear `score` head.

The reward of a sequence is the score at its last non-pad token:

    r(x) = h_L(x)[last] @ W_score^T,      h_L the final (normed) hidden states, W_score [num_labels, D]

`RewardModel` wraps a loaded classifier as a reward function with the project's one signature,
`(prompts, completions, **fields) -> list[float]`, scoring `prompt + completion` text in batches.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.errors import ConversionError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, forward, forward_packed
from jaxrl_llm.models.families import FAMILIES
from jaxrl_llm.models.hf import is_classifier, load_hf_model, read_tensor, resolve_model_dir
from jaxrl_llm.models.hf_export import save_hf_model
from jaxrl_llm.models.packing import PackedLayout, gather_predictors, packed_inputs
from jaxrl_llm.models.precision import matmul
from jaxrl_llm.models.tokenizer import load_tokenizer


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index `[B]` of each row's last token with `mask = 1` (0 for an empty row)."""
    t = mask.shape[-1]
    return t - 1 - jnp.argmax(jnp.flip(mask.astype(bool), axis=-1), axis=-1)


def sequence_scores(
    params: Params, score_kernel: jax.Array, config: ModelConfig, tokens: jax.Array, mask: jax.Array,
    layout: PackedLayout | None = None,
) -> jax.Array:
    """Classifier scores `[B, num_labels]` (float32) at the last valid token of each (left- or right-padded) row.

    `tokens, mask [B, T]`, `score_kernel [D, num_labels]` (the HF `score.weight` transposed). With a packed
    `layout` of the left-padded rows (its predictor `[B, 1]` each row's last token: `packing.batch_layout` with
    the full width as the prompt width) the forward pass runs on packed rows, no padding computed: the same scores.
    """
    if layout is None:
        hidden = forward(params, config, tokens, mask, return_hidden=True)
        last = jnp.take_along_axis(hidden, last_token_index(mask)[:, None, None], axis=1)[:, 0]
    else:
        rows, positions, segments = packed_inputs(tokens, mask, layout)
        last = gather_predictors(forward_packed(params, config, rows, positions, segments), layout)[:, 0]
    return matmul(last, score_kernel, config.jnp_dtype, jnp.float32)


def load_hf_reward_model(path_or_id: str | os.PathLike[str], **config_overrides: Any
                         ) -> tuple[ModelConfig, Params, jax.Array]:
    """`(config, decoder params, score kernel [D, num_labels])` of a HF `...ForSequenceClassification`."""
    model_dir = resolve_model_dir(path_or_id)
    if not is_classifier(model_dir):
        raise ConversionError(
            f"{model_dir} is not a sequence classifier (config.json architectures must end in "
            "'ForSequenceClassification')"
        )
    # The classifier has no language-model head: load the decoder as if tied so none is expected.
    config, params = load_hf_model(model_dir, tie_word_embeddings=True, **config_overrides)
    score = read_tensor(model_dir, "score.weight")
    if score.ndim != 2 or score.shape[1] != config.hidden_size:
        raise ConversionError(f"tensor 'score.weight' has shape {list(score.shape)} in the checkpoint in {model_dir}, "
                              f"expected [num_labels, {config.hidden_size}] from its config.json; re-export the model")
    return config, params, jnp.asarray(score.T)


@dataclasses.dataclass
class RewardModel:
    """A reward function backed by a sequence classifier: the score (label 0) of `prompt + completion`."""

    path: str
    batch_size: int = 64
    max_length: int = 1024

    def __post_init__(self) -> None:

        self.config, self.params, self.score_kernel = load_hf_reward_model(self.path)
        self.tokenizer = load_tokenizer(resolve_model_dir(self.path))
        self._scores = jax.jit(functools.partial(sequence_scores, config=self.config))

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], padding="longest", truncation=True,
                                 max_length=self.max_length, return_tensors="np", add_special_tokens=False)
            # Pad the length to a multiple of 64 so batches reuse compiled programs.
            width = -(-enc["input_ids"].shape[1] // 64) * 64
            pad = width - enc["input_ids"].shape[1]
            tokens = np.pad(enc["input_ids"], ((0, 0), (pad, 0)), constant_values=self.tokenizer.pad_token_id)
            mask = np.pad(enc["attention_mask"], ((0, 0), (pad, 0)))
            scores = self._scores(self.params, self.score_kernel, tokens=tokens, mask=mask)
            out.extend(np.asarray(scores[:, 0]).tolist())
        return out


def reward_model_reward(prompts: Sequence[str], completions: Sequence[str], *, path: str, **fields: Any) -> list[float]:
    """Built-in `reward_model` reward: `kwargs: {path: DIR_OR_HUB_ID}` (the model is loaded once per path)."""
    return _cached_reward_model(path)(prompts, completions, **fields)


@functools.lru_cache(maxsize=4)
def _cached_reward_model(path: str) -> RewardModel:
    return RewardModel(path)


def save_hf_reward_model(params: Params, score_kernel: jax.Array, config: ModelConfig,
                         out_dir: str | os.PathLike[str], *, tokenizer_dir: str | os.PathLike[str] | None = None,
                         pad_token_id: int | None = None) -> Any:
    """Write a HF `...ForSequenceClassification` directory (decoder + `score.weight [num_labels, D]`)."""

    num_labels = int(score_kernel.shape[1])
    family = FAMILIES.get(config.model_type)
    if family is None or family.classifier is None:
        supported = ", ".join(f.model_type for f in FAMILIES.values() if f.classifier)
        raise ConversionError(f"reward models (...ForSequenceClassification) are supported for {supported}, not "
                              f"{config.model_type}")
    extra_config = {
        "architectures": [family.classifier],
        "num_labels": num_labels,
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(num_labels)},
        "pad_token_id": pad_token_id,
    }
    score = np.ascontiguousarray(np.asarray(score_kernel, np.float32).T)
    return save_hf_model(params, config, out_dir, tokenizer_dir=tokenizer_dir,
                         extra_tensors={"score.weight": score}, extra_config=extra_config)
