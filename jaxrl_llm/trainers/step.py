"""Loss composition -> gradients -> optax update, as one jitted, data-parallel function.

`make_train_step` returns `step(params, opt_state, batch) -> (params, opt_state, metrics)`, jitted on a
`(data, fsdp, tensor)` device mesh (`jaxrl_llm.sharding`): the batch split over `data` x `fsdp`, params and
optimizer state placed by the partition rules (and donated). `jax.jit` inserts the gradient all-reduce and
the FSDP / tensor-parallel collectives: the design card's "pmapped train_step" in current JAX.
Gradient accumulation runs the micro-batches in a `lax.scan` inside the same jit; each micro-batch's loss is
normalised by the *whole* minibatch's token (or sequence) count, so the summed gradient equals the
full-batch gradient and token-mean is over the global token count however the batch is split.

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

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.config import OptimSection
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, forward, unembedding_matrix
from jaxrl_llm.rl.logprobs import token_logprobs_from_hidden
from jaxrl_llm.rl.losses import clipped_policy_loss
from jaxrl_llm.sharding import batch_sharding

Metrics = dict[str, jax.Array]
Carry = TypeVar("Carry")
StepFn = Callable[[Any, Any], tuple[Any, Metrics]]


class PolicyBatch(NamedTuple):
    """One minibatch of a rollout; every array has the sequence axis `N` first.

    prompt_tokens/prompt_mask `[N, P]` (left-padded), completion_tokens/completion_mask `[N, T]`
    (right-padded; mask 1 up to and including EOS), old_logp/ref_logp `[N, T]` float32, advantages `[N]`;
    sampler_logp `[N, T]` float32, the sampler's own log-probs when `rl.rollout_correction` weights the loss by
    `old / sampler` (then `old_logp` is the trainer's recomputation), else None; loss_mask `[N, T]`, in a
    multi-turn rollout 1 on the model's tokens and 0 on the environment's (which `completion_mask`, the attention
    mask, covers too), else None (the loss covers `completion_mask`).
    """

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    old_logp: jax.Array
    ref_logp: jax.Array
    advantages: jax.Array
    sampler_logp: jax.Array | None = None
    loss_mask: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Static knobs of the clipped policy loss (see `jaxrl_llm.rl.losses.clipped_policy_loss`)."""

    temperature: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip_c: float | None = None
    policy_loss: str = "ppo_clip"  # a name in rl.losses.POLICY_LOSSES
    # Extra static keywords of that surrogate, as (name, value) pairs (a dict would make the config unhashable):
    # SAPO's (("tau_pos", 1.0), ("tau_neg", 1.05)).
    surrogate_options: tuple[tuple[str, float], ...] = ()
    beta: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    entropy_coef: float = 0.0  # overridden by a traced `entropy_coef=` of `policy_loss` (adaptive control)
    top_entropy_quantile: float = 1.0  # < 1: the policy gradient only on the highest-entropy tokens
    clip_cov_ratio: float = 0.0  # > 0: Clip-Cov
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0  # > 0: KL-Cov
    kl_cov_coef: float = 1.0
    max_len: int | None = None
    # Budget of one float32 logits block `[rows, chunk, V]` in MiB: the completion's log-probs and entropy are
    # computed from the final hidden states `chunk` positions at a time (remat in the backward), never as a full
    # `[N, T, V]`. 0 = one block of all positions (what small vocabularies want).
    logprob_block_mib: float = 256.0
    # rl.rollout_correction's importance weighting: "" = none, else "<token|sequence>_<truncate|mask>" (applied
    # when the batch carries sampler_logp), and its cap C.
    rollout_correction: str = ""
    rollout_correction_cap: float = 3.0


def logprob_chunk_size(rows: int, length: int, vocab_size: int, block_mib: float) -> int:
    """Completion positions per log-prob chunk: the most whose float32 logits `[rows, chunk, V]` fit in
    `block_mib` MiB (at least 1); `length` (one block, no chunking) when everything fits or `block_mib == 0`."""
    if block_mib <= 0:
        return length
    return max(1, min(length, int(block_mib * 2**20) // (4 * rows * vocab_size)))


def completion_logprobs(
    params: Params,
    config: ModelConfig,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    completion_tokens: jax.Array,
    completion_mask: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    block_mib: float = 256.0,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """log pi(y_t | x, y_<t) at `temperature` for every completion token, `[N, T]` float32 (and entropy).

    One forward pass over `prompt + completion[:-1]` to the final hidden states `[N, T, D]`; the log-probs come
    from `token_logprobs_from_hidden` (`hidden @ W_out` in the compute dtype with float32 accumulation, one
    `[N, chunk, V]` float32 block at a time, see `logprob_chunk_size`), so neither `[N, P + T, V]` nor
    `[N, T, V]` logits are built for a large vocabulary.
    """
    p = prompt_tokens.shape[1]
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1)[:, :-1]
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1)[:, :-1]
    hidden = forward(params, config, tokens, mask, return_hidden=True, dropout_key=dropout_key)[:, p - 1 :]
    n, t = completion_tokens.shape
    chunk = logprob_chunk_size(n, t, config.vocab_size, block_mib)
    out = token_logprobs_from_hidden(hidden, unembedding_matrix(params, config), completion_tokens,
                                     temperature=temperature, chunk_size=chunk, with_entropy=with_entropy,
                                     logit_softcap=config.final_logit_softcap, compute_dtype=config.jnp_dtype)
    return out if with_entropy else (out, None)


def policy_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyLossConfig,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
    entropy_coef: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The GRPO/PPO policy objective of one (micro-)batch; returns `(loss, metrics)` (`frozen`, LoRA's base, is
    used by the step to make the weights, not here; `dropout_key`: LoRA dropout's randomness; `entropy_coef`, when
    given, a traced coefficient in place of `loss_config.entropy_coef`: the adaptive entropy controller's)."""
    c = loss_config
    logp, entropy = completion_logprobs(
        params,
        model_config,
        batch.prompt_tokens,
        batch.prompt_mask,
        batch.completion_tokens,
        batch.completion_mask,
        temperature=c.temperature,
        with_entropy=True,
        block_mib=c.logprob_block_mib,
        dropout_key=dropout_key,
    )
    return clipped_policy_loss(
        logp,
        batch.old_logp,
        batch.advantages,
        loss_mask(batch),
        epsilon_low=c.epsilon_low,
        epsilon_high=c.epsilon_high,
        dual_clip_c=c.dual_clip_c,
        surrogate=c.policy_loss,
        surrogate_options=dict(c.surrogate_options),
        ref_logp=batch.ref_logp if c.beta > 0 else None,
        sampler_logp=batch.sampler_logp if c.rollout_correction else None,
        tis_cap=c.rollout_correction_cap,
        rollout_correction=c.rollout_correction or "token_truncate",
        kl_coef=c.beta,
        kl_estimator=c.kl_estimator,  # type: ignore[arg-type]
        entropy=entropy,
        entropy_coef=c.entropy_coef if entropy_coef is None else entropy_coef,
        top_entropy_quantile=c.top_entropy_quantile,
        clip_cov_ratio=c.clip_cov_ratio,
        clip_cov_lb=c.clip_cov_lb,
        clip_cov_ub=c.clip_cov_ub,
        kl_cov_ratio=c.kl_cov_ratio,
        kl_cov_coef=c.kl_cov_coef,
        aggregation=c.aggregation,  # type: ignore[arg-type]
        max_len=c.max_len,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )


def sft_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyLossConfig,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the completion tokens: `-sum_t m_t log pi(y_t) / num_tokens` (token-mean)."""
    logp, _ = completion_logprobs(
        params, model_config, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask,
        block_mib=loss_config.logprob_block_mib, dropout_key=dropout_key,
    )
    mask = batch.completion_mask.astype(jnp.float32)
    loss = -(logp * mask).sum() / jnp.maximum(num_tokens, 1.0)
    return loss, {"sft_loss": loss}


LossFn = Callable[..., tuple[jax.Array, Metrics]]


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


def make_optimizer(cfg: OptimSection, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warmup then constant / cosine / linear decay, global-norm clipping, and a guard that skips
    any update whose gradients are not finite (`optax.apply_if_finite`) instead of corrupting the params."""
    decay_steps = max(total_updates - cfg.warmup_steps, 1)
    end = cfg.learning_rate * cfg.end_lr_ratio
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.end_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(cfg.learning_rate, end, decay_steps)
    else:
        decay = optax.constant_schedule(cfg.learning_rate)
    schedule = (
        optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps), decay],
                             [cfg.warmup_steps])
        if cfg.warmup_steps
        else decay
    )
    chain = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    chain.append(optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay))
    return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=1_000_000), schedule


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


def loss_mask(batch: Any) -> jax.Array:
    """The tokens a batch's loss covers `[N, T]`: the model's own (`loss_mask`), else every completion token."""
    own = getattr(batch, "loss_mask", None)
    return batch.completion_mask if own is None else own


def batch_counts(batch: Any) -> tuple[jax.Array, jax.Array]:
    """`(num_tokens, num_seqs)` of a batch: valid completion tokens and sequences with at least one, or the
    row count for both when the batch has no `completion_mask` (a preference batch)."""
    mask = loss_mask(batch) if hasattr(batch, "completion_mask") else None
    if mask is None:
        rows = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        return rows, rows
    return mask.sum().astype(jnp.float32), (mask.sum(axis=1) > 0).sum().astype(jnp.float32)


def train_step(
    params: Params,
    opt_state: optax.OptState,
    batch: PolicyBatch,
    frozen: Any = None,
    key: jax.Array | None = None,
    *,
    loss_fn: LossFn,
    model_config: ModelConfig,
    loss_config: PolicyLossConfig,
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

    def loss_of_master(master: Params, micro: PolicyBatch, index: jax.Array) -> tuple[jax.Array, Metrics]:
        weights = working_weights(master, model_config)
        if compose is not None:
            weights = compose(weights, frozen)
        dropout = {} if key is None else {"dropout_key": jax.random.fold_in(key, index)}
        return loss_fn(weights, micro, model_config=model_config, loss_config=loss_config, num_tokens=num_tokens,
                       num_seqs=num_seqs, **extra, **dropout, **(loss_inputs or {}))

    grad_fn = jax.value_and_grad(loss_of_master, has_aux=True)

    def accumulate(grads: Params, xs: tuple[PolicyBatch, jax.Array]) -> tuple[Params, tuple[jax.Array, Metrics]]:
        (loss, metrics), g = grad_fn(params, *xs)
        return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    micro_batches = jax.tree.map(split, batch)
    grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(grad_accum)))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    micro_tokens = jax.vmap(lambda micro: batch_counts(micro)[0])(micro_batches)
    metrics = reduce_metrics(metrics, micro_tokens, sum_losses=True)
    metrics["loss"] = losses.sum()
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics["update_skipped"] = jnp.logical_not(opt_state.last_finite).astype(jnp.float32)
    return params, opt_state, metrics


def make_train_step(
    mesh: Mesh,
    *,
    loss_fn: LossFn,
    model_config: ModelConfig,
    loss_config: PolicyLossConfig,
    optimizer: optax.GradientTransformation,
    grad_accum: int = 1,
    params_sharding: Any = None,
    opt_state_sharding: Any = None,
    frozen_sharding: Any = None,
    compose: Callable[[Params, Any], Params] | None = None,
    with_key: bool = False,
) -> Callable[..., tuple[Params, optax.OptState, Metrics]]:
    """`train_step` jitted over `mesh`, params and optimizer state donated; with `frozen_sharding` (the
    placement of a `frozen` pytree, see `train_step`) the step takes `(params, opt_state, batch, frozen)`, and
    with `with_key` a last argument `key` (LoRA dropout's randomness).

    The batch is split over `("data", "fsdp")`; params and optimizer state are placed by
    `params_sharding` / `opt_state_sharding` (pytrees of `NamedSharding`, from `jaxrl_llm.sharding`), or
    replicated when not given. XLA inserts the gradient reductions (all-reduce over `data`, reduce-scatter
    over `fsdp`) and the tensor-parallel collectives.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    step = functools.partial(
        train_step,
        loss_fn=loss_fn,
        model_config=model_config,
        loss_config=loss_config,
        optimizer=optimizer,
        grad_accum=grad_accum,
        compose=compose,
    )
    params_sharding = replicated if params_sharding is None else params_sharding
    opt_state_sharding = replicated if opt_state_sharding is None else opt_state_sharding
    in_shardings = (params_sharding, opt_state_sharding, batch_sharding(mesh))
    if frozen_sharding is not None or with_key:
        in_shardings = (*in_shardings, frozen_sharding)
    if with_key:
        in_shardings = (*in_shardings, replicated)
    return jax.jit(
        step,
        in_shardings=in_shardings,
        out_shardings=(params_sharding, opt_state_sharding, replicated),
        donate_argnums=(0, 1),
    )


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


def state_sharding(state: Any) -> Any:
    """The placement of every array of a state pytree, as `jit_update` takes it."""
    return jax.tree.map(lambda x: x.sharding, state)


def make_logprob_fn(
    mesh: Mesh, model_config: ModelConfig, temperature: float, params_sharding: Any = None, block_mib: float = 256.0
) -> Callable[..., jax.Array]:
    """Jitted `(params, prompt_tokens, prompt_mask, completion_tokens, completion_mask) -> logp [N, T]`
    (the reference model's pass), batch split over `("data", "fsdp")`."""
    params_sharding = NamedSharding(mesh, PartitionSpec()) if params_sharding is None else params_sharding
    rows = batch_sharding(mesh)

    def fn(params: Params, pt: jax.Array, pm: jax.Array, ct: jax.Array, cm: jax.Array) -> jax.Array:
        return completion_logprobs(params, model_config, pt, pm, ct, cm, temperature=temperature,
                                   block_mib=block_mib)[0]

    return jax.jit(fn, in_shardings=(params_sharding, *[rows] * 4), out_shardings=rows)


def minibatch_rows(key: jax.Array, num_rows: int, *, epochs: int, minibatch_size: int) -> jax.Array:
    """Row indices of every update, `[epochs * num_rows // minibatch_size, minibatch_size]` int32: each epoch a
    fresh permutation `permutation(fold_in(key, epoch), num_rows)` cut into consecutive minibatches."""
    orders = [jax.random.permutation(jax.random.fold_in(key, epoch), num_rows) for epoch in range(epochs)]
    return jnp.concatenate(orders).reshape(-1, minibatch_size).astype(jnp.int32)


def scanned_updates(step: StepFn, carry: Carry, batch: Any, key: jax.Array, *, epochs: int, minibatch_size: int,
                    constrain: Callable[[Any], Any] = lambda x: x) -> tuple[Carry, Metrics, Metrics]:
    """Run `step(carry, minibatch) -> (carry, metrics)` over `epochs` shuffled passes of `batch` (a pytree of
    arrays with the row axis first). Returns `(carry, reduced metrics, stacked metrics [U])`; `constrain` puts
    each gathered minibatch back in the batch sharding."""
    num_rows = jax.tree.leaves(batch)[0].shape[0]
    rows = minibatch_rows(key, num_rows, epochs=epochs, minibatch_size=minibatch_size)

    def one_update(carry: Carry, idx: jax.Array) -> tuple[Carry, Metrics]:
        minibatch = constrain(jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch))
        return step(carry, minibatch)

    carry, stacked = jax.lax.scan(one_update, carry, rows)
    return carry, reduce_metrics(stacked), stacked
