"""The update: one data-parallel optimizer update (`train_step`, with an optimizer from `jaxrl_llm.optim`), the
epochs x minibatches of a rollout as one `lax.scan` (`scanned_updates`), and the one jit every algorithm's update
goes through (`jit_update`). The losses it differentiates: `jaxrl_llm.trainers.objectives`.

`train_step(params, opt_state, batch, ...)` runs on a `(data, fsdp, expert, tensor)` device mesh (`jaxrl_llm.sharding`)
inside `jit_update`'s jit: the batch split over `data` x `fsdp`, state placed by the partition rules (and donated).
`jax.jit` inserts the gradient all-reduce and the FSDP / tensor-parallel collectives: the design card's "pmapped
train_step" in current JAX. Gradient accumulation runs the micro-batches in a `lax.scan` inside the same jit; each
micro-batch's loss is normalised by the *whole* minibatch's token (or sequence) count, so the summed gradient
equals the full-batch gradient and token-mean is over the global token count however the batch is split.

`scanned_updates` runs the epochs x minibatches of one rollout as a `lax.scan` inside the caller's jit (as in
purejaxrl)::

    for epoch in range(epochs):                                  scan over epochs * N / M updates
        order = permutation(fold_in(key, epoch), N)              the shuffle, on the device
        for rows in order.reshape(N // M, M):
            carry, metrics = step(carry, batch[rows])            one optimizer update (train_step)
    metrics = reduce_metrics(metrics stacked over the updates)

The rollout goes to the devices once; each minibatch is a gather on the device, constrained back to the batch
sharding, so the data-parallel train step inside sees the layout it would as its own jit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.weights import working_weights
from jaxrl_llm.sharding import batch_sharding
from jaxrl_llm.trainers.objectives import LossFn, batch_counts

Metrics = dict[str, jax.Array]
Carry = TypeVar("Carry")
StepFn = Callable[[Any, Any], tuple[Any, Metrics]]


COUNTERS = ("update_skipped",)  # metric names summed, not averaged (suffixes)


def reduce_metrics(stacked: Metrics, weights: jax.Array | None = None, *, sum_losses: bool = False) -> Metrics:
    """One reducer for metrics stacked over micro-batches or over the updates of a step, `[A]` each -> scalars.

    ::

        name/min -> min,  name/max -> max,  *update_skipped -> sum (and last_update_skipped = the last entry)
        *loss    -> sum if sum_losses (micro-batch losses are already normalised by the global count)
        others   -> sum_a w_a x_a,  w = weights / sum(weights)  (uniform without weights)

    Micro-batch metrics are masked means over each micro-batch's tokens, so token-count weights make them equal
    the whole minibatch's value however it is split.
    """
    first = next(iter(stacked.values()))
    w = jnp.ones(first.shape[:1], jnp.float32) if weights is None else weights.astype(jnp.float32)
    w = w / jnp.maximum(w.sum(), 1e-12)
    out = {}
    for name, values in stacked.items():
        if name.endswith("/min"):
            out[name] = values.min()
        elif name.endswith("/max"):
            out[name] = values.max()
        elif name.endswith(COUNTERS):
            out[name] = values.sum()
            out[name.replace("update_skipped", "last_update_skipped")] = values[-1]
        elif sum_losses and name.endswith("loss"):
            out[name] = values.sum()
        else:
            out[name] = (values * w).sum()
    return out


def train_step(
    params: Params,
    opt_state: optax.OptState,
    batch: Any,
    frozen: Any = None,
    key: jax.Array | None = None,
    *,
    loss_fn: LossFn,
    model_config: ModelConfig,
    loss_config: Any,
    optimizer: optax.GradientTransformation,
    grad_accum: int,
    compose: Callable[[Params, Any], Params] | None = None,
    loss_inputs: dict[str, jax.Array] | None = None,
) -> tuple[Params, optax.OptState, Metrics]:
    """One optimizer update from a minibatch `[N, ...]` split into `grad_accum` micro-batches.

    `params` are the float32 master weights (`master_weights`) of what is trained; the loss runs on
    `working_weights` (the master cast to `model_config.param_dtype`), and the update is applied to the master.
    `frozen` is a pytree the loss reads but nothing updates or differentiates (a reference model, LoRA's base
    weights): it reaches `loss_fn` as `frozen=`, and `compose(working weights, frozen)`, when given, makes the
    model's weights from both (LoRA: base + scale * A @ B). `key`, when given, is the randomness of LoRA dropout:
    each micro-batch's loss gets `dropout_key=fold_in(key, i)`. `loss_inputs` are traced scalars every
    micro-batch's `loss_fn` gets as keywords (the adaptive entropy coefficient: `{"entropy_coef": c}`)."""
    num_tokens, num_seqs = batch_counts(batch)

    def split(x: jax.Array) -> jax.Array:
        # Strided micro-batches keep each device's rows on the micro-batch axis (no resharding).
        return x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)

    extra = {} if frozen is None else {"frozen": frozen}

    def loss_of_master(master: Params, micro: Any, index: jax.Array) -> tuple[jax.Array, Metrics]:
        weights = working_weights(master, model_config)
        if compose is not None:
            weights = compose(weights, frozen)
        dropout = {} if key is None else {"dropout_key": jax.random.fold_in(key, index)}
        return loss_fn(weights, micro, model_config=model_config, loss_config=loss_config, num_tokens=num_tokens,
                       num_seqs=num_seqs, **extra, **dropout, **(loss_inputs or {}))

    grad_fn = jax.value_and_grad(loss_of_master, has_aux=True)

    def accumulate(grads: Params, xs: tuple[Any, jax.Array]) -> tuple[Params, tuple[jax.Array, Metrics]]:
        (loss, metrics), g = grad_fn(params, *xs)
        return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    micro_batches = jax.tree.map(split, batch)
    if grad_accum == 1:  # no accumulator: a zero-filled float32 copy of the parameters and one add less
        (loss, metrics), grads = grad_fn(params, jax.tree.map(lambda x: x[0], micro_batches), jnp.int32(0))
        losses, metrics = loss[None], jax.tree.map(lambda x: x[None], metrics)
    else:
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(grad_accum)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    micro_tokens = jax.vmap(lambda micro: batch_counts(micro)[0])(micro_batches)
    metrics = reduce_metrics(metrics, micro_tokens, sum_losses=True)
    metrics["loss"] = losses.sum()
    metrics["grad_norm"] = optax.tree.norm(grads)
    with jax.named_scope("optimizer"):  # the profile's op kinds (bench/update_profile.py) read the scopes
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    metrics["update_skipped"] = jnp.logical_not(opt_state.last_finite).astype(jnp.float32)
    return params, opt_state, metrics


def jit_update(update: Callable[..., tuple[Any, Metrics]], mesh: Mesh, sharding: Any, *,
               frozen_sharding: Any = None, extra_shardings: tuple[Any, ...] = ()) -> Callable[..., Any]:
    """The one jit of every algorithm's update: `update(state, batch, key, frozen, *extra) -> (state, metrics)`
    with the state placed by `sharding` and donated, the batch split over `("data", "fsdp")`, the key and
    the metrics replicated, `frozen` (LoRA's base, a reference model, or None) placed by `frozen_sharding`, and
    `extra` (traced scalars such as an adaptive coefficient, or None) by `extra_shardings`."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(update, in_shardings=(sharding, batch_sharding(mesh), replicated, frozen_sharding, *extra_shardings),
                   out_shardings=(sharding, replicated), donate_argnums=(0,))


def single_step_update(step: Callable[..., tuple[Params, optax.OptState, Metrics]], *, with_key: bool
                       ) -> Callable[..., tuple[dict[str, Any], Metrics]]:
    """`update(state, batch, key, frozen)` of a one-step-per-batch algorithm (SFT, reward model, DPO) over the
    state `{"params", "opt_state"}`, for `jit_update`: `step` is `train_step` with its loss bound; the key
    reaches it only `with_key` (LoRA dropout)."""

    def update(state: dict[str, Any], batch: Any, key: jax.Array, frozen: Any) -> tuple[dict[str, Any], Metrics]:
        params, opt_state, metrics = step(state["params"], state["opt_state"], batch, frozen,
                                          key if with_key else None)
        return {"params": params, "opt_state": opt_state}, metrics

    return update


def jit_one_step_update(mesh: Mesh, state_shardings: dict[str, Any], *, frozen_sharding: Any = None,
                        with_key: bool = False, **step_options: Any) -> Callable[..., tuple[dict[str, Any], Metrics]]:
    """`update(state, batch, key, frozen) -> (state, metrics)` over the state `{"params", "opt_state"}`: one
    `train_step` (with `step_options`: loss_fn, model_config, loss_config, optimizer, grad_accum, compose) through
    `single_step_update` and `jit_update`, the state placed by `state_shardings` (`sharding.train_state_shardings`,
    or `state_sharding` of a built state) and donated. What SFT, DPO and the reward model run, and what a test of
    one optimizer update calls."""
    step = functools.partial(train_step, **step_options)
    return jit_update(single_step_update(step, with_key=with_key), mesh, state_shardings,
                      frozen_sharding=frozen_sharding)


def state_sharding(state: Any) -> Any:
    """The placement of every array of a state pytree, as `jit_update` takes it."""
    return jax.tree.map(lambda x: x.sharding, state)


def minibatch_rows(key: jax.Array, num_rows: int, *, epochs: int, minibatch_size: int) -> jax.Array:
    """Row indices of every update, `[epochs * num_rows // minibatch_size, minibatch_size]` int32: each epoch a
    fresh permutation `permutation(fold_in(key, epoch), num_rows)` cut into consecutive minibatches."""
    orders = [jax.random.permutation(jax.random.fold_in(key, epoch), num_rows) for epoch in range(epochs)]
    return jnp.concatenate(orders).reshape(-1, minibatch_size).astype(jnp.int32)


def scanned_updates(step: StepFn, carry: Carry, batch: Any, key: jax.Array, *, epochs: int, minibatch_size: int,
                    constrain: Callable[[Any], Any] = lambda x: x, per_update: Any = None,
                    attach: Callable[[Any, Any], Any] | None = None,
                    rows: jax.Array | None = None) -> tuple[Carry, Metrics, Metrics]:
    """Run `step(carry, minibatch) -> (carry, metrics)` over `epochs` shuffled passes of `batch` (a pytree of
    arrays with the row axis first). Returns `(carry, reduced metrics, stacked metrics [U])`; `constrain` puts
    each gathered minibatch back in the batch sharding. `per_update`, a pytree with the update axis `[U]` first
    (the packed layouts the host planned for these same `minibatch_rows`), reaches each minibatch through
    `attach(minibatch, its entry)`. `rows [U, MB]`, when given, are the updates' minibatch rows in place of
    `minibatch_rows(key, ...)` (the host's reordering of those same rows into token-balanced micro-batches)."""
    num_rows = jax.tree.leaves(batch)[0].shape[0]
    if rows is None:
        rows = minibatch_rows(key, num_rows, epochs=epochs, minibatch_size=minibatch_size)

    def one_update(carry: Carry, xs: tuple[jax.Array, Any]) -> tuple[Carry, Metrics]:
        idx, extra = xs
        minibatch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)
        if attach is not None:
            minibatch = attach(minibatch, extra)
        return step(carry, constrain(minibatch))

    if rows.shape[0] == 1:  # one update (mu = 1, one minibatch): no loop carrying the whole state through
        carry, metrics = one_update(carry, jax.tree.map(lambda x: x[0], (rows, per_update)))
        stacked = jax.tree.map(lambda x: x[None], metrics)
    else:
        carry, stacked = jax.lax.scan(one_update, carry, (rows, per_update))
    return carry, reduce_metrics(stacked), stacked
