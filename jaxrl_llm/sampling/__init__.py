"""Jitted sampler: one prefill of a left-padded prompt batch, then a `lax.while_loop` decode on a KV cache.

`sample(params, model_config, prompt_tokens, prompt_mask, key, sampling)` is the one entry point.

Program shape (one XLA program per prompt bucket, completion bucket, batch size and static switch set):

1. Prefill: the prompt batch `[B, P_b]` (left-padded, `P_b` = longest prompt rounded up to a multiple of
   `prompt_bucket`) runs once through the decoder, filling per-layer caches `[B, P_b, KVH, hd]`; only the
   last position is unembedded (`logits [B, V]`): the `[B, P_b, V]` prompt logits are never built.
2. `n` samples per prompt: the prompt's caches and last logits are repeated `n` times along the batch
   (`jnp.repeat`, prompt-major rows), so the prompt is computed once, not `n` times, and padded with the
   empty completion slots (`T_b` = `max_new_tokens` rounded up to a multiple of `new_tokens_bucket`), and
   transposed once to the decode loop's layout (`loop_caches`): keys `[B*n, KVH, hd, P_b + T_b]`, values
   `[B*n, KVH, P_b + T_b, hd]`.
3. Decode: `lax.while_loop` over new tokens, one `T = 1` decoder step per iteration, until every row has
   emitted one of `eos_ids` or `max_new_tokens` tokens were made. The loop bound and the sampling knobs
   (temperature, top-k, top-p, min-p values, `max_new_tokens`) are traced values, so every call whose
   lengths fall into one bucket reuses one compiled program; only *whether* greedy / top-k / top-p / min-p
   is on, `n`, `eos_ids` and `pad_id` are static (they change the program).

The decoder's layers run unrolled over per-layer weights and caches, both through the one layer stack
(`models/stack.py: run_layers`): `decode_layers` (the training forward's Flax layers) for the prefill, and
`decode_token` (the stack on fused q|k|v and gate|up weights, over caches laid out as the attention contractions read
them, so XLA does not transpose the caches on every step) in the loop: inside a while loop, a scan over the stacked
`[L, ...]` arrays would copy every layer's weights and cache slice out and the updated cache back on every token.

KV-cache memory: allocated once per call, inside the jitted program, as one key and one value buffer per
layer, `[B*n, KVH, hd, P_b + T_b]` and `[B*n, KVH, P_b + T_b, hd]` (together as large as one
`[L, B*n, P_b + T_b, KVH, hd]` cache), in the model's compute dtype:

    cache_bytes = 2 * L * (B * n) * (P_b + T_b) * KVH * hd * itemsize(dtype)

(e.g. Qwen2.5-0.5B, L=24, KVH=2, hd=64, bf16, B*n=64, P_b + T_b = 1024: 2*24*64*1024*2*64*2 B = 805 MB).
The prefill caches (`B` rows, `P_b` slots) live only until they are broadcast. The cache never crosses the
jit boundary: it is created, updated and dropped inside the one program, carried by `lax.while_loop` as
loop-carried buffers that XLA updates in place (a token step writes one slot, `B*n * KVH * hd` values, per
layer and buffer). That is what donating a cache passed in from outside would achieve, with nothing for the caller
to manage; no copy of the cache is made per step. The per-layer weights (`StepWeights`: one copy of the
layer weights, q|k|v and gate|up concatenated) are also made once per call, outside the loop.

Sampling semantics of one step, from the float32 logits `z [B*n, V]` of the next token:
- greedy: `token = argmax(z)` (first index on ties, as torch). The sampled distribution is a point mass, so
  `logprobs = 0`; `logprobs_untruncated = log_softmax(z)[token]` (temperature 1).
- otherwise `s = z / temperature`, then truncation in transformers' order (top-k, then top-p, then min-p),
  each keeping a set `K` of tokens (ties at a threshold are all kept, so `K` may exceed `top_k` on ties):
  - top-k: keep `s_v >= s_(k)` (the k-th largest);
  - top-p: in descending order of the top-k-renormalised probabilities `p_(1) >= p_(2) >= ...`, keep the
    smallest prefix whose mass reaches `top_p`: rank `j` is kept iff `sum_{i<j} p_(i) < top_p`;
  - min-p: keep `p_v >= min_p * max_v p_v`, i.e. `s_v >= max(s) + log(min_p)`.
  The token is drawn from `q = softmax(s restricted to K)` by inverse CDF with one uniform per row, and
  - `logprobs = log q(token) = s_token - logsumexp_{v in K} s_v`: the log-prob under the distribution
    actually sampled from (the behaviour policy of the rollout, truncation included);
  - `logprobs_untruncated = log_softmax(s)[token] = s_token - logsumexp_v s_v`: the full-vocabulary
    log-prob at the same temperature: what a trainer's recomputation `log_softmax(logits / T)[token]` over
    prompt + completion gives for the same parameters (tested to 1e-4), hence the consistent old-policy
    log-prob for an importance ratio against such a recomputation. Without truncation the two are equal.
  Both are 0 on masked (post-EOS / beyond-length) positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decode import (
    decode_layers,
    decode_token,
    longrope_original,
    longrope_switch,
    loop_caches,
    prefill,
    split_layers,
)
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.models.layers import positions_from_mask
from jaxrl_llm.models.moe import NO_RECORD
from jaxrl_llm.models.step_weights import StepWeights, constrain_step_weights, fusable_shards, step_weights
from jaxrl_llm.sampling.config import (
    Knobs,
    SampleOutput,
    SamplingConfig,
    _Static,
    bucket_length,
    knobs_from_config,
)
from jaxrl_llm.sampling.logits import sample_from_logits
from jaxrl_llm.sharding import BATCH_AXES, constrain, global_array, mesh_of

# --------------------------------------------------------------------------------------- the program


def _completion_caches(prompt_caches: list[Any], n: int, new_tokens: int, mesh: Mesh | None,
                       config: ModelConfig) -> list[Any]:
    """The prompts' caches broadcast to `n` samples each (prompt-major rows), in the decode loop's
    `loop_caches` layout (transposed here once per call, not by XLA inside every step), with `new_tokens`
    empty completion slots appended on the slot axis. A hybrid stack keeps the decoder's layout (its loop runs
    `decode_layers`), and a linear-attention layer's state is copied to the `n` samples as it is: the prompt's end
    state is every sample's start."""
    def extend(a: jax.Array, slot_axis: int) -> jax.Array:
        slots = [(0, new_tokens if axis == slot_axis else 0) for axis in range(a.ndim)]
        return constrain(jnp.pad(jnp.repeat(a, n, axis=0), slots), mesh, PartitionSpec(BATCH_AXES, "tensor"))

    if config.is_hybrid:
        return [jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), c) if config.is_linear(i)
                else {"k": extend(c["k"], 1), "v": extend(c["v"], 1)} for i, c in enumerate(prompt_caches)]
    return [{"k": extend(c["k"], 3), "v": extend(c["v"], 2)} for c in loop_caches(prompt_caches)]


def _emit(i: jax.Array | int, logits: jax.Array, done: jax.Array, length: jax.Array, outputs: tuple[jax.Array, ...],
          *, key: jax.Array, knobs: Knobs, static: _Static) -> tuple[jax.Array, jax.Array, jax.Array, tuple]:
    """Sample completion token `i` for every row from `logits [R, V]` into column `i` of `outputs` (tokens,
    log-probs, untruncated log-probs); rows already done get padding. Returns `(token, done, length, outputs)`."""
    token, logprob, untruncated = sample_from_logits(
        logits,
        jax.random.fold_in(key, i),
        knobs,
        greedy=static.greedy,
        use_top_k=static.top_k,
        use_top_p=static.top_p,
        use_min_p=static.min_p,
    )
    active = ~done
    token = jnp.where(active, token, static.pad_id)
    columns = (token, jnp.where(active, logprob, 0.0), jnp.where(active, untruncated, 0.0))
    outputs = tuple(
        jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), i, axis=1)
        for buf, col in zip(outputs, columns, strict=True)
    )
    eos_ids = jnp.asarray(static.eos_ids, jnp.int32)
    hit_eos = jnp.any(token[:, None] == eos_ids, axis=-1) if static.eos_ids else jnp.zeros_like(done)
    return token, done | (active & hit_eos), length + active.astype(jnp.int32), outputs


def _decode_loop(step: Callable[..., tuple[jax.Array, Any, Any]], emit: Callable[..., tuple], max_new: jax.Array,
                 state: tuple, experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple, Any]:
    """`lax.while_loop` over tokens `i = 1, 2, ...` while `i < max_new` and some row is not done: `step` feeds
    token `i - 1` and gives the logits of token `i` (and an MoE model's experts of the fed token, written to column
    `i - 1` of `experts [R, T_b, L, k]` for the rows still going), `emit` samples it. `state = (i, token, caches,
    done, length, outputs)`; returns the final `(done, length, outputs, experts)`."""
    def keep_going(state: tuple) -> jax.Array:
        i, _, _, done, _, _, _ = state
        return (i < max_new) & ~jnp.all(done)

    def body(state: tuple) -> tuple:
        i, token, caches, done, length, outputs, recorded = state
        logits, caches, chosen = step(i, token, caches)
        if recorded is not None:
            fed = jnp.where(done[:, None, None], NO_RECORD, chosen)[:, None]
            recorded = jax.lax.dynamic_update_slice_in_dim(recorded, fed.astype(recorded.dtype), i - 1, axis=1)
        token, done, length, outputs = emit(i, logits, done, length, outputs)
        return i + 1, token, caches, done, length, outputs, recorded

    _, _, _, done, length, outputs, experts = jax.lax.while_loop(keep_going, body, (*state, experts))
    return done, length, outputs, experts


def _completion_key_mask(prompt_mask: jax.Array, n: int, new_tokens: int) -> tuple[jax.Array, jax.Array]:
    """The decode loop's key mask `[B * n, P_b + T_b]` (each prompt's mask, then every completion slot valid)
    and the position of completion token 0 of each row `[B * n]` (its prompt's length)."""
    rows = prompt_mask.shape[0] * n
    # Completion slots are all marked valid up front: causality (key slot <= query slot) already hides the
    # slots not written yet, so the key mask never changes inside the loop.
    key_mask = jnp.concatenate(
        [jnp.repeat(prompt_mask, n, axis=0), jnp.ones((rows, new_tokens), prompt_mask.dtype)], axis=1
    )
    return key_mask, jnp.repeat(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32), n)


def _empty_outputs(rows: int, new_tokens: int, pad_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loop's outputs before the first token: tokens (all `pad_id`), log-probs, untruncated log-probs,
    each `[rows, new_tokens]`."""
    return (
        jnp.full((rows, new_tokens), pad_id, jnp.int32),
        jnp.zeros((rows, new_tokens), jnp.float32),
        jnp.zeros((rows, new_tokens), jnp.float32),
    )


def _token_step(params: Params, weights: list[StepWeights], config: ModelConfig, key_mask: jax.Array,
                first_position: jax.Array, prompt_len: int, shards: int,
                layer_params: list[Params]) -> Callable[[jax.Array, jax.Array, Any], tuple[jax.Array, Any, Any]]:
    """The loop body's model call `step(i, token, caches) -> (logits, caches, experts)`: feed token `i - 1` (cache slot
    `P_b + i - 1`) and get the logits of token `i`; a longrope model switches to its long factors on the step
    the batch's longest row first reaches past the original context. A hybrid stack (linear-attention layers) runs
    `decode_layers` on `layer_params` (its linear layers have no prepared `StepWeights`)."""
    original = longrope_original(config)
    key_positions = positions_from_mask(key_mask) if original is not None else None

    def step(i: jax.Array, token: jax.Array, caches: Any) -> tuple[jax.Array, Any]:
        slot = prompt_len + i - 1
        if original is not None:  # the batch's longest row reaches past longrope's original context now
            reach = jnp.max(first_position) + i  # transformers' seq_len of this call; the previous one was 1 less
            caches = jax.lax.cond((reach > original) & (reach - 1 <= original),
                                  lambda c: longrope_switch(c, config, key_positions), lambda c: c, caches)
        if config.is_hybrid:  # the Flax layers, over the decoder's cache layout and the linear layers' states
            logits, caches, chosen = decode_layers(params, layer_params, config, token[:, None],
                                                   (first_position + i - 1)[:, None], key_mask, caches, slot)
            return logits[:, 0].astype(jnp.float32), caches, None if chosen is None else chosen[:, 0]
        return decode_token(params, weights, config, token, first_position + i - 1, key_mask, caches, slot, shards)

    return step


@functools.partial(jax.jit, static_argnames=("config", "static", "mesh"))
def _sample_program(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    key: jax.Array,
    knobs: Knobs,
    *,
    config: ModelConfig,
    static: _Static,
    mesh: Mesh | None = None,
) -> SampleOutput:
    """Prefill + while-loop decode on bucketed inputs; outputs have `T_b = static.new_tokens` columns.

    On a `mesh`, rows are split over `("data", "fsdp")` and the caches' KV heads over `tensor`; the
    per-layer token-step weights are gathered over `fsdp` once per call (kept split over `tensor`), not
    on every token.
    """
    n, new_tokens = static.n, static.new_tokens
    prompt_len = prompt_tokens.shape[1]
    rows_spec = PartitionSpec(BATCH_AXES)
    prompt_tokens, prompt_mask = constrain(prompt_tokens, mesh, rows_spec), constrain(prompt_mask, mesh, rows_spec)
    layer_params = split_layers(params, config)
    shards = fusable_shards(config, mesh.shape["tensor"]) if mesh is not None else 1
    weights = ([] if config.is_hybrid else
               [constrain_step_weights(w, mesh) for w in step_weights(layer_params, config, shards)])

    # Prefill the B prompts once; the n samples of a prompt share it.
    logits, prompt_caches, prompt_experts = prefill(params, layer_params, config, prompt_tokens, prompt_mask)

    logits = jnp.repeat(logits, n, axis=0)
    caches = _completion_caches(prompt_caches, n, new_tokens, mesh, config)
    rows = logits.shape[0]
    key_mask, first_position = _completion_key_mask(prompt_mask, n, new_tokens)
    emit = functools.partial(_emit, key=key, knobs=knobs, static=static)
    outputs = _empty_outputs(rows, new_tokens, static.pad_id)
    token, done, length, outputs = emit(0, logits, jnp.zeros((rows,), bool), jnp.zeros((rows,), jnp.int32), outputs)
    max_new = jnp.minimum(knobs.max_new_tokens, new_tokens)
    step = _token_step(params, weights, config, key_mask, first_position, prompt_len, shards, layer_params)
    experts = None
    if prompt_experts is not None:  # an MoE model records its routing: the prompt's, then each fed token's
        prompt_experts = jnp.where(prompt_mask[:, :, None, None] > 0, prompt_experts, NO_RECORD).astype(jnp.int16)
        experts = jnp.full((rows, new_tokens, *prompt_experts.shape[2:]), NO_RECORD, jnp.int16)
    done, length, outputs, experts = _decode_loop(step, emit, max_new,
                                                  (jnp.int32(1), token, caches, done, length, outputs), experts)
    tokens, logprobs, untruncated = outputs
    mask = (jnp.arange(new_tokens)[None, :] < length[:, None]).astype(jnp.int32)
    routing = None if experts is None else jnp.concatenate([jnp.repeat(prompt_experts, n, axis=0), experts], axis=1)
    out = SampleOutput(tokens, mask, logprobs, untruncated, length, done, routing)
    return jax.tree.map(lambda x: constrain(x, mesh, rows_spec), out)


def bucket_prompts(
    prompt_tokens: Any, prompt_mask: Any, sampling: SamplingConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded `[B, P]` prompts -> `[B, P_b]` int32 numpy, `P_b = bucket_length(longest row)`.

    All-padding leading columns are dropped first, then padding (`pad_id`, mask 0) is added on the left;
    every masked slot holds `pad_id`.
    Raises `ValueError` unless every row is left-padded (mask `0...0 1...1`) with at least one token.
    """
    tokens = np.asarray(prompt_tokens, dtype=np.int32)
    mask = np.asarray(prompt_mask, dtype=np.int32)
    if tokens.ndim != 2 or tokens.shape != mask.shape:
        raise ValueError(f"prompt_tokens {tokens.shape} and prompt_mask {mask.shape} must both be [B, P]")
    lengths = mask.sum(axis=1)
    if ((mask != 0) & (mask != 1)).any() or (np.diff(mask, axis=1) < 0).any():
        raise ValueError("prompts must be left-padded: each prompt_mask row must be 0...0 1...1")
    if (lengths < 1).any():
        raise ValueError(f"every prompt needs at least one token; empty rows: {np.flatnonzero(lengths < 1)}")
    longest = int(lengths.max())
    padded_len = bucket_length(longest, sampling.prompt_bucket)
    out_tokens = np.full((tokens.shape[0], padded_len), sampling.pad_id, np.int32)
    out_mask = np.zeros((tokens.shape[0], padded_len), np.int32)
    out_tokens[:, padded_len - longest :] = np.where(mask, tokens, sampling.pad_id)[:, tokens.shape[1] - longest :]
    out_mask[:, padded_len - longest :] = mask[:, mask.shape[1] - longest :]
    return out_tokens, out_mask


def _static_from_config(sampling: SamplingConfig) -> _Static:
    """The switches of `sampling` that change the program (one compiled program per distinct set)."""
    s = sampling
    return _Static(new_tokens=bucket_length(s.max_new_tokens, s.new_tokens_bucket), greedy=s.greedy,
                   top_k=s.uses_top_k, top_p=s.uses_top_p, min_p=s.uses_min_p, n=s.n, eos_ids=s.eos_ids,
                   pad_id=s.pad_id)


def _program_args(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    tokens, mask = bucket_prompts(prompt_tokens, prompt_mask, sampling)
    if mesh is not None:
        # Every process holds the same host prompts; each device receives only its rows.
        tokens, mask = global_array(tokens, mesh, PartitionSpec(BATCH_AXES)), global_array(
            mask, mesh, PartitionSpec(BATCH_AXES))
    args = (params, tokens, mask, key, knobs_from_config(sampling))
    return args, {"config": model_config, "static": _static_from_config(sampling), "mesh": mesh}


def sample(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> SampleOutput:
    """Sample `sampling.n` completions for each prompt of a left-padded batch.

    `prompt_tokens, prompt_mask [B, P]` (numpy or jax; mask 1 = token, rows left-padded). `key` is a
    `jax.random.key`: the same key gives the same tokens, so a trainer folds a fresh one per step. Returns a
    `SampleOutput` with `B * n` prompt-major rows and exactly `sampling.max_new_tokens` columns.
    With a `mesh` (and `params` placed by `jaxrl_llm.sharding`), the batch is split over its `data` and
    `fsdp` axes and the KV cache's heads over `tensor`; the tokens are the same as on one device.
    """
    args, static = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
    return _trim(_sample_program(*args, **static), sampling.max_new_tokens, np.shape(prompt_tokens)[1])


def _trim(out: SampleOutput, columns: int, prompt_width: int) -> SampleOutput:
    """Drop the completion bucket's excess columns (beyond `max_new_tokens`); an MoE model's routing record gets the
    caller's prompt width (`prompt_width` columns, right-aligned: the program saw the prompts re-bucketed)."""
    if out.routing is not None:
        bucketed = out.routing.shape[1] - out.tokens.shape[1]
        prompt, completion = out.routing[:, :bucketed], out.routing[:, bucketed:bucketed + columns]
        keep = prompt[:, max(0, bucketed - prompt_width):]
        pad = jnp.full((keep.shape[0], prompt_width - keep.shape[1], *keep.shape[2:]), NO_RECORD, keep.dtype)
        out = out._replace(routing=jnp.concatenate([pad, keep, completion], axis=1))
    if out.tokens.shape[1] == columns:
        return out
    return out._replace(
        tokens=out.tokens[:, :columns],
        mask=out.mask[:, :columns],
        logprobs=out.logprobs[:, :columns],
        logprobs_untruncated=out.logprobs_untruncated[:, :columns],
    )


def compile_sampler(
    params: Params, model_config: ModelConfig, prompt_tokens: Any, prompt_mask: Any, key: jax.Array,
    sampling: SamplingConfig, mesh: Mesh | None = None,
) -> Callable[[Params, Any, Any, jax.Array], SampleOutput]:
    """Compile (ahead of time, without running) the program `sample` would use for these inputs.

    Returns `run(params, prompt_tokens, prompt_mask, key) -> SampleOutput`, which executes that compiled
    program for any inputs of the same buckets and `sampling`, so callers can time compilation apart from
    generation (the CLI and the benchmark do).
    """
    args, static = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
    compiled = _sample_program.lower(*args, **static).compile()

    def run(params: Params, prompt_tokens: Any, prompt_mask: Any, key: jax.Array) -> SampleOutput:
        args, _ = _program_args(params, model_config, prompt_tokens, prompt_mask, key, sampling, mesh)
        return _trim(compiled(*args), sampling.max_new_tokens, np.shape(prompt_tokens)[1])

    return run


class Sampler(Protocol):
    """What a sampler is to the trainers, the evaluation and the commands, whichever one `sampling.engine` names
    (`engine.make_sampler`): `sampling.n` completions of each prompt of a left-padded batch,
    `(params, tokens [B, P], mask [B, P], key, sampling, mesh) -> SampleOutput` (prompt-major rows of token ids,
    their log-probs as sampled and untruncated, lengths, whether each stopped on EOS, and for an MoE model the experts
    every token was routed to), the weights on `mesh` (None: where they are); `describe(mesh)`: itself in words, for
    a run's header. `keeps_conversations`, a capability: whether `conversations(sequences, n, mesh)` gives an engine
    that continues kept conversations turn after turn (`generate(requests, sampling, keep=True)`, `release`), which
    a multi-turn rollout uses; without it each turn samples the whole context again through the call. An external
    engine is a class with this shape (docs/extending.md)."""

    keeps_conversations: bool

    def __call__(self, params: Params, tokens: Any, mask: Any, key: jax.Array, sampling: SamplingConfig,
                 mesh: Mesh | None = None) -> SampleOutput: ...

    def describe(self, mesh: Mesh) -> str: ...

    def conversations(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh | None = None) -> Any: ...


class StaticSampler:
    """`Sampler` over `sample`: one jitted prefill and decode loop per call (`sampling.engine=static`)."""

    keeps_conversations = False

    def __init__(self, config: ModelConfig, why: str = "") -> None:
        self.config, self.why = config, why  # why: the reason it stands in for the rollout engine, if it does

    def describe(self, mesh: Mesh) -> str:
        return f"the static sampler{f' ({self.why})' if self.why else ''}"

    def conversations(self, sequences: list[tuple[int, int]], n: int, mesh: Mesh | None = None) -> Any:
        raise ValueError("the static sampler keeps no conversations (keeps_conversations is False): each turn of a "
                         "multi-turn rollout samples its whole context again through the call")

    def __call__(self, params: Params, tokens: Any, mask: Any, key: jax.Array, sampling: SamplingConfig,
                 mesh: Mesh | None = None) -> SampleOutput:
        mesh = mesh if mesh is not None else mesh_of(params, None)  # where the weights are
        return sample(params, self.config, tokens, mask, key, sampling, mesh=mesh)


def compiled_program_count() -> int:
    """Number of sampler programs compiled in this process (one per bucket and static switch set)."""
    return _sample_program._cache_size()
