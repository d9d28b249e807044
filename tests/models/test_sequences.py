"""The one form of a batch of sequences (jaxrl_llm/models/sequences.py): what the model reads, what the loss covers,
and that it travels as one pytree (placed, sliced, jitted) with its arrays unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.sequences import Sequences, model_inputs


def test_model_inputs_are_prompt_then_completion_but_its_last_token():
    """`model_inputs` (the one place `prompt + completion[:-1]` is written): by hand, in the prompt's dtype; numpy
    stays numpy (the host's layouts), a JAX array stays JAX (inside the update)."""
    prompt, completion = np.array([[0, 5, 6], [7, 8, 9]], np.int32), np.array([[1, 2, 0], [3, 0, 0]], np.int8)
    got = model_inputs(prompt, completion)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32
    assert got.tolist() == [[0, 5, 6, 1, 2], [7, 8, 9, 3, 0]]
    on_device = model_inputs(jnp.asarray(prompt), jnp.asarray(completion))
    assert isinstance(on_device, jax.Array) and np.asarray(on_device).tolist() == got.tolist()


def _two_rows(loss_mask: np.ndarray | None = None) -> Sequences:
    # Row 0: prompt [5, 6] (one pad), completion [1, 2, EOS=9]; row 1: prompt [7, 8, 4], completion [3] then padding.
    return Sequences(np.array([[0, 5, 6], [7, 8, 4]]), np.array([[0, 1, 1], [1, 1, 1]]),
                     np.array([[1, 2, 9], [3, 0, 0]]), np.array([[1, 1, 1], [1, 0, 0]]), loss_mask)


def test_inputs_and_the_tokens_the_loss_covers():
    s = _two_rows()
    tokens, mask = s.inputs()
    assert tokens.tolist() == [[0, 5, 6, 1, 2], [7, 8, 4, 3, 0]]  # the last completion token is no input
    assert mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert s.prompt_width == 3 and s.width == 6
    assert s.targets_mask().tolist() == [[1, 1, 1], [1, 0, 0]]  # no loss mask: the completion's attention mask
    multi_turn = _two_rows(np.array([[1, 0, 1], [1, 0, 0]]))  # an environment's token in row 0, column 1
    assert multi_turn.targets_mask().tolist() == [[1, 0, 1], [1, 0, 0]]
    assert multi_turn.inputs()[1].tolist() == mask.tolist()  # attention still covers the environment's token


def test_sequences_travel_as_one_pytree():
    """Placed, a minibatch's rows taken and passed through `jax.jit` as one argument: every array arrives whole, and
    an absent loss mask stays absent (no leaf)."""
    s = _two_rows()
    assert len(jax.tree.leaves(s)) == 4 and len(jax.tree.leaves(_two_rows(np.ones((2, 3))))) == 5
    placed = jax.tree.map(jnp.asarray, s)
    row = jax.jit(lambda seqs: jax.tree.map(lambda x: x[1:], seqs))(placed)
    assert isinstance(row, Sequences) and row.loss_mask is None
    assert np.asarray(row.inputs()[0]).tolist() == [[7, 8, 4, 3, 0]]
