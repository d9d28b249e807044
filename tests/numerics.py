"""Numerical references and checks: float32 rounding bounds, jit/vmap agreement, a plain forward pass's
logits and log-probs, and the element types of a compiled module's dots."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.decoder import forward

FLOAT32_UNIT_ROUNDOFF = 2.0**-24


def assert_within_rounding(got: Any, want: Any, terms: int) -> None:
    """Two float32 programs meant to compute the same values, in sums of at most `terms` rounded additions each,
    agree to their rounding: |got - want| <= 2 terms u max|want| (u = 2^-24; 2: both round; the recursive
    summation bound n u sum|x_i|, with the largest value standing in for the sum of the terms' magnitudes). Where
    XLA fuses the two differently, they are bit-equal on one CPU class and a few u apart on another."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = 2 * terms * FLOAT32_UNIT_ROUNDOFF * np.abs(want).max()
    worst = np.abs(got - want).max()
    assert worst <= bound, f"off by {worst:.3g} > {bound:.3g} (2 x {terms} x u x max|want|)"


def assert_jit_vmap_agree(fn, *args) -> None:
    """``jit(fn)`` equals eager ``fn``; ``jit(vmap(fn))`` over 3 perturbed copies equals per-copy results."""
    jitted = jax.jit(fn)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), jitted(*args), fn(*args))
    copies = [
        jax.tree.map(lambda a, k=k: a * (1 + 0.1 * k) if jnp.issubdtype(a.dtype, jnp.floating) else a, args)
        for k in range(3)
    ]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *copies)
    batched = jax.jit(jax.vmap(fn))(*stacked)
    for k, c in enumerate(copies):
        jax.tree.map(lambda a, b, k=k: np.testing.assert_allclose(a[k], b, rtol=1e-5, atol=1e-6), batched, jitted(*c))


forward_jit = jax.jit(forward, static_argnums=1)


def fresh_logits(params, config, prompt_tokens, prompt_mask, out, n: int) -> np.ndarray:
    """A plain forward pass over prompt + completion: the logits that predict each completion token."""
    prompts = np.repeat(prompt_tokens, n, axis=0)
    masks = np.repeat(prompt_mask, n, axis=0)
    tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    mask = np.concatenate([masks, np.asarray(out.mask)], axis=1)
    logits = forward_jit(params, config, jnp.asarray(tokens), jnp.asarray(mask))
    p = prompt_tokens.shape[1]
    return np.asarray(logits[:, p - 1 : p - 1 + out.tokens.shape[1]], np.float32)


def gather_logprobs(logprobs: np.ndarray, tokens) -> np.ndarray:
    return np.take_along_axis(logprobs, np.asarray(tokens)[..., None], axis=-1)[..., 0]


_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[")

_COMPILED_DOT = re.compile(r"= \w+\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")


def compiled_dot_operand_types(compiled_text: str) -> list[tuple[str, str]]:
    """Element types of both operands of every dot in a compiled XLA module (fusion bodies included): what the
    backend runs, after its passes, which the lowered program does not show."""
    types = dict(_DEFINITION.findall(compiled_text))
    return [(types[a], types[b]) for a, b in _COMPILED_DOT.findall(compiled_text)]
