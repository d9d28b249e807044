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
from jaxrl_llm.models.decoder import Params, RoutedHidden, completion_hidden, unembedding_as_stored
from jaxrl_llm.models.moe import NO_RECORD, expert_load, load_balancing_loss, router_disagreement, routing_confidence
from jaxrl_llm.models.packing import PackedLayout
from jaxrl_llm.models.sequences import Sequences
from jaxrl_llm.rl.logprobs import logprob_chunk_size, token_logprobs_from_hidden
from jaxrl_llm.rl.policy_loss import PolicyLossOptions, clipped_policy_loss
from jaxrl_llm.sharding import batch_sharding

Metrics = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Metrics]]


class PolicyBatch(NamedTuple):
    """One minibatch of a rollout; every array has the sequence axis `N` first.

    sequences, the rollout's (`models.sequences.Sequences`: prompts `[N, P]` left-padded, completions `[N, T]`
    right-padded with their attention mask, 1 up to and including EOS, and in a multi-turn rollout the loss mask, 1
    on the model's tokens and 0 on the environment's); old_logp/ref_logp `[N, T]` float32, advantages `[N]`;
    sampler_logp `[N, T]` float32, the sampler's own log-probs when `rl.loss.rollout_correction` weights the loss by
    `old / sampler` (then `old_logp` is the trainer's recomputation), else None; layout, the packed rows the forward
    pass runs on (`jaxrl_llm.models.packing`, `rl.packing`), else None (the padded layout); routing `[N, P + T, L,
    k]`, an MoE model's recorded experts of every token of `prompt + completion` (`moe.NO_RECORD` where none),
    replayed when the objective says so (`rl.routing_replay`) and compared with the live router's choice either way,
    else None.
    """

    sequences: Sequences
    old_logp: jax.Array
    ref_logp: jax.Array
    advantages: jax.Array
    sampler_logp: jax.Array | None = None
    layout: PackedLayout | None = None
    routing: jax.Array | None = None


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
    routing_replay: bool = False  # MoE: the forward uses the batch's recorded experts (rl.routing_replay)
    router_aux_loss_coef: float = 0.0  # MoE: the load-balancing loss's weight in the loss (model.router_aux_loss_coef)


def policy_objective(c: RunConfig, *, beta: float) -> PolicyObjective:
    """The run's policy objective (the one place it is built): `rl.loss`, `rl.policy_loss` and its
    `rl.policy_loss_kwargs`, `rl.entropy_coef`, `sampling.temperature` and `max_new_tokens`,
    `model.logprob_block_mib`; `beta`: the KL coefficient the loss carries (0 when the KL is in the reward)."""
    r = c.rl
    settings = tuple(sorted(r.policy_loss_kwargs.items()))
    return PolicyObjective(options=r.loss, surrogate=r.policy_loss, settings=settings, beta=beta,
                           entropy_coef=r.entropy_coef, temperature=c.sampling.temperature,
                           max_len=c.sampling.max_new_tokens, logprob_block_mib=c.model.logprob_block_mib,
                           routing_replay=r.routing_replay != "none",
                           router_aux_loss_coef=c.model.router_aux_loss_coef)


class CompletionLogprobs(NamedTuple):
    """`completion_logprobs`' result: `logp [N, T]` float32, the entropy `[N, T]` (None without `with_entropy`) and
    the forward's `decoder.RoutedHidden` (an MoE model's routing, for its router terms and records)."""

    logp: jax.Array
    entropy: jax.Array | None
    routed: RoutedHidden


def completion_logprobs(
    params: Params, config: ModelConfig, sequences: Sequences, *, temperature: float = 1.0,
    with_entropy: bool = False, block_mib: float = 256.0, dropout_key: jax.Array | None = None,
    layout: PackedLayout | None = None, replay: jax.Array | None = None,
) -> CompletionLogprobs:
    """log pi(y_t | x, y_<t) at `temperature` for every completion token, `[N, T]` float32 (and entropy).

    One forward pass over `prompt + completion[:-1]` to the final hidden states `[N, T, D]`; the log-probs come
    from `token_logprobs_from_hidden` (`hidden @ W_out` in the compute dtype with float32 accumulation, one
    `[N, chunk, V]` float32 block at a time, see `logprob_chunk_size`), so neither `[N, P + T, V]` nor
    `[N, T, V]` logits are built for a large vocabulary. With a packed `layout` the forward pass runs on its rows
    (`decoder.completion_hidden`: no padding computed): the same function. An MoE model replays `replay [N, P + T, L,
    k]` where given (`decoder.completion_hidden`).
    """
    routed = completion_hidden(params, config, sequences, layout=layout, dropout_key=dropout_key, replay=replay)
    n, t = sequences.completion_tokens.shape
    chunk = logprob_chunk_size(n, t, config.vocab_size, block_mib)
    unembed, transposed = unembedding_as_stored(params, config)
    out = token_logprobs_from_hidden(routed.hidden, unembed, sequences.completion_tokens,
                                     temperature=temperature, chunk_size=chunk, with_entropy=with_entropy,
                                     logit_softcap=config.final_logit_softcap, compute_dtype=config.jnp_dtype,
                                     unembed_transposed=transposed)
    logp, entropy = out if with_entropy else (out, None)
    return CompletionLogprobs(logp, entropy, routed)


def router_terms(routed: RoutedHidden, config: ModelConfig, coef: float, records: jax.Array | None = None,
                 layout: PackedLayout | None = None) -> tuple[jax.Array, Metrics]:
    """An MoE model's router in the loss and the metrics: `(coef * load-balancing loss, metrics)`; `(0, {})` for a
    dense model. Metrics, over the forward's real tokens: `moe/aux_loss` (`moe.load_balancing_loss`), per layer
    (`moe/layer_XX/...`) and averaged over layers, `load_max_mean` (max / mean tokens per expert) and `confidence`
    (the top-k's probability mass), and with `records [N, P + T, L, k]` `router_disagreement`: the share of the
    recorded tokens whose live top-k set differs from the record (whether or not the record was replayed)."""
    if routed.routing is None:
        return jnp.zeros((), jnp.float32), {}
    k, e, layers = config.num_experts_per_tok, config.num_experts, config.num_layers
    logits = routed.routing.logits.reshape(layers, -1, e)
    mask = routed.token_mask.reshape(-1).astype(jnp.float32)
    aux = load_balancing_loss(logits, k, mask)
    live = jax.lax.top_k(logits, k)[1]  # [L, B * S, k]: what the router chose, replayed or not
    top, mean = expert_load(live, e, mask)
    per_layer = {"load_max_mean": top / jnp.maximum(mean, 1e-9), "confidence": routing_confidence(logits, k, mask)}
    if records is not None:
        forced = records[:, :-1].astype(jnp.int32)
        if layout is not None:
            pad = layout.source < 0
            forced = jnp.where(pad[..., None, None], NO_RECORD,
                               forced.reshape(-1, *forced.shape[2:])[jnp.where(pad, 0, layout.source)])
        forced = jnp.moveaxis(forced, 2, 0).reshape(layers, -1, k)  # [L, B * S, k]
        recorded = mask * (forced[0, :, 0] != NO_RECORD)
        per_layer["router_disagreement"] = router_disagreement(live, forced, recorded)
    metrics: Metrics = {"moe/aux_loss": aux}
    for name, values in per_layer.items():
        metrics[f"moe/{name}"] = jnp.mean(values)
        metrics |= {f"moe/layer_{i:02d}/{name}": values[i] for i in range(layers)}
    return coef * aux, metrics


def policy_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyObjective,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
    entropy_coef: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The GRPO/PPO policy objective of one (micro-)batch; returns `(loss, metrics)` (`frozen`, LoRA's base, is
    used by the step to make the weights, not here; `dropout_key`: LoRA dropout's randomness; `entropy_coef`, when
    given, a traced coefficient in place of the objective's fixed one: the adaptive entropy controller's). An MoE
    model replays `batch.routing` under `routing_replay` and adds its router's terms (`router_terms`)."""
    c = loss_config
    logp, entropy, routed = completion_logprobs(
        params, model_config, batch.sequences, temperature=c.temperature, with_entropy=True,
        block_mib=c.logprob_block_mib, dropout_key=dropout_key, layout=batch.layout,
        replay=batch.routing if c.routing_replay else None,
    )
    loss, metrics = clipped_policy_loss(
        logp, batch.old_logp, batch.advantages, batch.sequences.targets_mask(), c.options, surrogate=c.surrogate,
        settings=dict(c.settings), ref_logp=batch.ref_logp if c.beta > 0 else None, kl_coef=c.beta, entropy=entropy,
        entropy_coef=c.entropy_coef if entropy_coef is None else entropy_coef, sampler_logp=batch.sampler_logp,
        max_len=c.max_len, num_tokens=num_tokens, num_seqs=num_seqs,
    )
    aux, router_metrics = router_terms(routed, model_config, c.router_aux_loss_coef, batch.routing, batch.layout)
    return loss + aux * _share(batch, num_seqs), metrics | router_metrics


def _share(batch: Any, num_seqs: jax.Array) -> jax.Array:
    """This micro-batch's share of the minibatch's sequences (those with a token in the loss): micro-batch losses
    are summed over the minibatch, so a per-micro-batch mean term (the load-balancing loss) is weighted by it."""
    own = (batch.sequences.targets_mask().sum(axis=1) > 0).sum().astype(jnp.float32)
    return own / jnp.maximum(num_seqs, 1.0)


def sft_loss(
    params: Params, batch: PolicyBatch, *, model_config: ModelConfig, loss_config: PolicyObjective,
    num_tokens: jax.Array, num_seqs: jax.Array, frozen: Any = None, dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Cross-entropy of the completion tokens: `-sum_t m_t log pi(y_t) / num_tokens` (token-mean), plus an MoE
    model's router terms (`router_terms`)."""
    logp, _, routed = completion_logprobs(
        params, model_config, batch.sequences, block_mib=loss_config.logprob_block_mib, dropout_key=dropout_key,
        layout=batch.layout,
    )
    mask = batch.sequences.completion_mask.astype(jnp.float32)
    loss = -(logp * mask).sum() / jnp.maximum(num_tokens, 1.0)
    aux, router_metrics = router_terms(routed, model_config, loss_config.router_aux_loss_coef, layout=batch.layout)
    return loss + aux * _share(batch, num_seqs), {"sft_loss": loss} | router_metrics


def batch_counts(batch: Any) -> tuple[jax.Array, jax.Array]:
    """`(num_tokens, num_seqs)` of a batch: the tokens its loss covers (`Sequences.targets_mask`) and the sequences
    with at least one, or the row count for both when the batch has no `sequences` (a preference batch)."""
    sequences = getattr(batch, "sequences", None)
    if sequences is None:  # a preference batch
        rows = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        return rows, rows
    mask = sequences.targets_mask()
    return mask.sum().astype(jnp.float32), (mask.sum(axis=1) > 0).sum().astype(jnp.float32)


def live_records(routed: RoutedHidden, config: ModelConfig, shape: tuple[int, int],
                 layout: PackedLayout | None = None) -> jax.Array:
    """The experts the router itself ranks top-k at every input position (its own choice, even where the pass replayed
    another), as a record `[N, P + T, L, k]` int16 aligned with `prompt + completion` (`shape = (N, P + T)`;
    `moe.NO_RECORD` on padding and on the last completion token, which is no input)."""
    k, layers = config.num_experts_per_tok, config.num_layers
    assert routed.routing is not None
    live = jax.lax.top_k(routed.routing.logits, k)[1].astype(jnp.int16)  # [L, B, S, k]
    live = jnp.where(routed.token_mask[None, :, :, None] > 0, live, NO_RECORD)
    n, width = shape
    if layout is None:
        per_token = jnp.moveaxis(live, 0, 2)  # [N, S, L, k]
    else:  # packed rows back to their sequences' positions
        rows = jnp.moveaxis(live, 0, 2).reshape(-1, layers, k)  # [R * S, L, k]
        source = layout.source.reshape(-1)
        per_token = jnp.full((n * (width - 1), layers, k), NO_RECORD, jnp.int16)
        per_token = per_token.at[jnp.where(source < 0, n * (width - 1), source)].set(rows, mode="drop")
        per_token = per_token.reshape(n, width - 1, layers, k)
    return jnp.pad(per_token, ((0, 0), (0, 1), (0, 0), (0, 0)), constant_values=NO_RECORD)


def make_logprob_fn(mesh: Mesh, model_config: ModelConfig, temperature: float, params_sharding: Any = None,
                    block_mib: float = 256.0, records: bool = False) -> Callable[..., Any]:
    """The whole-batch pass (the reference model's, the old policy's): jitted `(params, sequences, layout=None,
    replay=None) -> logp [N, T]`, batch split over `("data", "fsdp")`. With a packed `layout` of the whole batch
    (`packing.batch_layout`, replicated) the forward pass runs on its rows: no padding computed, the same log-probs.
    An MoE model replays `replay [N, P + T, L, k]` where given, and with `records` the result is `(logp, live records
    [N, P + T, L, k])` (`live_records`: the router's own top-k at every input)."""
    params_sharding = NamedSharding(mesh, PartitionSpec()) if params_sharding is None else params_sharding
    rows, whole = batch_sharding(mesh), NamedSharding(mesh, PartitionSpec())

    def fn(params: Params, sequences: Sequences, layout: PackedLayout | None = None,
           replay: jax.Array | None = None) -> Any:
        logp, _, routed = completion_logprobs(params, model_config, sequences, temperature=temperature,
                                              block_mib=block_mib, layout=layout, replay=replay)
        if not records:
            return logp
        return logp, live_records(routed, model_config, (len(sequences.prompt_tokens), sequences.width), layout)

    compiled: dict[tuple[bool, bool], Any] = {}

    def call(params: Params, sequences: Sequences, layout: PackedLayout | None = None,
             replay: jax.Array | None = None) -> Any:
        sequences = sequences._replace(loss_mask=None)  # the pass reads no loss mask: one program with or without
        key = (layout is not None, replay is not None)
        if key not in compiled:
            shardings = (params_sharding, jax.tree.map(lambda _: rows, sequences),
                         whole if layout is not None else None, rows if replay is not None else None)
            compiled[key] = jax.jit(fn, in_shardings=shardings, out_shardings=(rows, rows) if records else rows)
        return compiled[key](params, sequences, layout, replay)

    return call
