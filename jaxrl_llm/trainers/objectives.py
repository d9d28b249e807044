"""What the train step differentiates: the batch types, the policy objective (`PolicyObjective`, built from a run by
`policy_objective`), the model glue that turns weights and a batch into completion log-probs, and the losses the
algorithms plug into `jaxrl_llm.trainers.step.train_step` (the policy loss, SFT's cross-entropy).

A loss function has the signature::

    loss_fn(weights, batch, *, model_config, loss_config, num_tokens, num_seqs, frozen=None, dropout_key=None,
            **traced_inputs) -> (scalar loss, metrics)

with `num_tokens` / `num_seqs` the whole minibatch's counts (`batch_counts`), so micro-batch losses sum to the
minibatch's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.config import RunConfig
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params, completion_hidden, unembedding_as_stored
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.rl.logprobs import token_logprobs_from_hidden
from jaxrl_llm.rl.policy_loss import PolicyLossOptions, clipped_policy_loss
from jaxrl_llm.sharding import batch_sharding

Metrics = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Metrics]]


class PolicyBatch(NamedTuple):
    """One minibatch of a rollout; every array has the sequence axis `N` first.

    prompt_tokens/prompt_mask `[N, P]` (left-padded), completion_tokens/completion_mask `[N, T]`
    (right-padded; mask 1 up to and including EOS), old_logp/ref_logp `[N, T]` float32, advantages `[N]`;
    sampler_logp `[N, T]` float32, the sampler's own log-probs when `rl.loss.rollout_correction` weights the loss by
    `old / sampler` (then `old_logp` is the trainer's recomputation), else None; loss_mask `[N, T]`, in a
    multi-turn rollout 1 on the model's tokens and 0 on the environment's (which `completion_mask`, the attention
    mask, covers too), else None (the loss covers `completion_mask`); layout, the packed rows the forward pass
    runs on (`jaxrl_llm.models.packing`, `rl.packing`), else None (the padded layout).
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
    layout: PackedLayout | None = None


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """The policy objective beyond the batch, hashable (a static argument of the jitted update): the run's `rl.loss`
    options as they are, the surrogate by name with its own settings (`rl.policy_loss_kwargs`, as sorted pairs),
    the KL coefficient the loss carries (`beta`: 0 = no KL term, no reference pass), the fixed entropy coefficient,
    the sampling temperature the log-probs are taken at, the constant of `seq-mean-token-sum-norm`, and the memory
    of one log-prob block (`model.logprob_block_mib`; 0 = all completion positions at once). A run's is built by
    `policy_objective`; a library user writes the fields that differ from these neutral defaults."""

    options: PolicyLossOptions = PolicyLossOptions()
    surrogate: str = "ppo_clip"
    settings: tuple[tuple[str, Any], ...] = ()
    beta: float = 0.0
    entropy_coef: float = 0.0  # overridden by a traced `entropy_coef=` of `policy_loss` (adaptive control)
    temperature: float = 1.0
    max_len: int | None = None
    logprob_block_mib: float = 0.0


def policy_objective(c: RunConfig, *, beta: float) -> PolicyObjective:
    """The run's policy objective (the one place it is built): `rl.loss`, `rl.policy_loss` and its
    `rl.policy_loss_kwargs`, `rl.entropy_coef`, `sampling.temperature` and `max_new_tokens`,
    `model.logprob_block_mib`; `beta`: the KL coefficient the loss carries (0 when the KL is in the reward)."""
    r = c.rl
    settings = tuple(sorted(r.policy_loss_kwargs.items()))
    return PolicyObjective(options=r.loss, surrogate=r.policy_loss, settings=settings, beta=beta,
                           entropy_coef=r.entropy_coef, temperature=c.sampling.temperature,
                           max_len=c.sampling.max_new_tokens, logprob_block_mib=c.model.logprob_block_mib)


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
    layout: PackedLayout | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """log pi(y_t | x, y_<t) at `temperature` for every completion token, `[N, T]` float32 (and entropy).

    One forward pass over `prompt + completion[:-1]` to the final hidden states `[N, T, D]`; the log-probs come
    from `token_logprobs_from_hidden` (`hidden @ W_out` in the compute dtype with float32 accumulation, one
    `[N, chunk, V]` float32 block at a time, see `logprob_chunk_size`), so neither `[N, P + T, V]` nor
    `[N, T, V]` logits are built for a large vocabulary. With a packed `layout` the forward pass runs on its rows
    (`decoder.completion_hidden`: no padding computed): the same function.
    """
    hidden = completion_hidden(params, config, prompt_tokens, prompt_mask, completion_tokens, completion_mask,
                               layout=layout, dropout_key=dropout_key)
    n, t = completion_tokens.shape
    chunk = logprob_chunk_size(n, t, config.vocab_size, block_mib)
    unembed, transposed = unembedding_as_stored(params, config)
    out = token_logprobs_from_hidden(hidden, unembed, completion_tokens,
                                     temperature=temperature, chunk_size=chunk, with_entropy=with_entropy,
                                     logit_softcap=config.final_logit_softcap, compute_dtype=config.jnp_dtype,
                                     unembed_transposed=transposed)
    return out if with_entropy else (out, None)


def policy_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyObjective,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
    entropy_coef: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The GRPO/PPO policy objective of one (micro-)batch; returns `(loss, metrics)` (`frozen`, LoRA's base, is
    used by the step to make the weights, not here; `dropout_key`: LoRA dropout's randomness; `entropy_coef`, when
    given, a traced coefficient in place of the objective's fixed one: the adaptive entropy controller's)."""
    c = loss_config
    logp, entropy = completion_logprobs(
        params, model_config, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask,
        temperature=c.temperature, with_entropy=True, block_mib=c.logprob_block_mib, dropout_key=dropout_key,
        layout=batch.layout,
    )
    return clipped_policy_loss(
        logp, batch.old_logp, batch.advantages, loss_mask(batch), c.options, surrogate=c.surrogate,
        settings=dict(c.settings), ref_logp=batch.ref_logp if c.beta > 0 else None, kl_coef=c.beta, entropy=entropy,
        entropy_coef=c.entropy_coef if entropy_coef is None else entropy_coef, sampler_logp=batch.sampler_logp,
        max_len=c.max_len, num_tokens=num_tokens, num_seqs=num_seqs,
    )


def sft_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyObjective,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the completion tokens: `-sum_t m_t log pi(y_t) / num_tokens` (token-mean)."""
    logp, _ = completion_logprobs(
        params, model_config, batch.prompt_tokens, batch.prompt_mask, batch.completion_tokens, batch.completion_mask,
        block_mib=loss_config.logprob_block_mib, dropout_key=dropout_key, layout=batch.layout,
    )
    mask = batch.completion_mask.astype(jnp.float32)
    loss = -(logp * mask).sum() / jnp.maximum(num_tokens, 1.0)
    return loss, {"sft_loss": loss}


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


def make_logprob_fn(
    mesh: Mesh, model_config: ModelConfig, temperature: float, params_sharding: Any = None, block_mib: float = 256.0
) -> Callable[..., jax.Array]:
    """Jitted `(params, prompt_tokens, prompt_mask, completion_tokens, completion_mask, layout=None) -> logp [N, T]`
    (the reference model's pass, and the old policy's), batch split over `("data", "fsdp")`; with a packed `layout`
    of the whole batch (`packing.batch_layout`, replicated) the forward pass runs on its rows: no padding computed,
    the same log-probs."""
    params_sharding = NamedSharding(mesh, PartitionSpec()) if params_sharding is None else params_sharding
    rows, whole = batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())

    def fn(params: Params, pt: jax.Array, pm: jax.Array, ct: jax.Array, cm: jax.Array,
           layout: PackedLayout | None = None) -> jax.Array:
        return completion_logprobs(params, model_config, pt, pm, ct, cm, temperature=temperature,
                                   block_mib=block_mib, layout=layout)[0]

    padded = jax.jit(fn, in_shardings=(params_sharding, *[rows] * 4), out_shardings=rows)
    packed = jax.jit(fn, in_shardings=(params_sharding, *[rows] * 4, whole), out_shardings=rows)

    def call(params: Params, pt: jax.Array, pm: jax.Array, ct: jax.Array, cm: jax.Array,
             layout: PackedLayout | None = None) -> jax.Array:
        return padded(params, pt, pm, ct, cm) if layout is None else packed(params, pt, pm, ct, cm, layout)

    return call
