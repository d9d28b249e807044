"""The one form a batch of sequences takes from where a rollout is collected to every loss: `Sequences`.

A sequence is a prompt and a completion: the prompt left-padded `[N, P]` (so every row's last prompt token sits in
column `P - 1`, where sampling starts), the completion right-padded `[N, T]`. The model reads `prompt +
completion[:-1]` (`model_inputs`: the position `P - 1 + t` predicts completion token `t`), attention covers
`completion_mask` (1 up to and including EOS, and on an environment's tokens in a multi-turn episode), and the loss
covers `loss_mask` (the model's own tokens; None: the completion mask).

It is a pytree (a `NamedTuple` of arrays), so it travels as one argument through `jax.jit`, `jax.tree.map` (placing
it on the mesh, taking a minibatch's rows) and `lax.scan`; numpy arrays on the host, JAX arrays on the mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def model_inputs(prompt: Any, completion: Any) -> Any:
    """`concat(prompt, completion)[:, :-1]` `[N, P + T - 1]` (in `prompt`'s dtype): what the model reads to predict
    each completion token, of token ids or of their masks (`prompt [N, P]` left-padded, `completion [N, T]`
    right-padded). The position `P - 1 + t` predicts completion token `t`; the last completion token is no input.
    Numpy arrays stay numpy (the host's layouts); JAX arrays and tracers stay JAX."""
    xp = jnp if isinstance(prompt, jax.Array) or isinstance(completion, jax.Array) else np
    return xp.concatenate([prompt, completion.astype(prompt.dtype)], axis=1)[:, :-1]


class Sequences(NamedTuple):
    """`N` prompt + completion sequences: `prompt_tokens, prompt_mask [N, P]` (left-padded), `completion_tokens,
    completion_mask [N, T]` (right-padded; the attention mask), `loss_mask [N, T]` (the tokens the loss covers, in a
    multi-turn episode the model's own; None: `completion_mask`)."""

    prompt_tokens: Any
    prompt_mask: Any
    completion_tokens: Any
    completion_mask: Any
    loss_mask: Any = None

    def inputs(self) -> tuple[Any, Any]:
        """`(tokens, mask) [N, P + T - 1]`: the model's input tokens and their attention mask (`model_inputs`)."""
        return (model_inputs(self.prompt_tokens, self.completion_tokens),
                model_inputs(self.prompt_mask, self.completion_mask))

    def targets_mask(self) -> Any:
        """`[N, T]`: the completion tokens the loss covers (`loss_mask`, else `completion_mask`)."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def prompt_width(self) -> int:
        """`P`: the prompts' padded width."""
        return int(self.prompt_tokens.shape[1])

    @property
    def width(self) -> int:
        """`P + T`: a whole sequence's padded width."""
        return int(self.prompt_tokens.shape[1] + self.completion_tokens.shape[1])
