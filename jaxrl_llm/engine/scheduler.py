"""The rollout engine's host side: continuous batching over the paged KV cache.

    requests ──admit (pages reserved)──> prefill once per prompt ──fork n samples──> ready ──> decode slots
        ^                                                                                      │ EOS / limit
        └──────────── queued while the pool cannot hold them ◄── pages released ◄──────────────┘

- **Admission**: a request (a prompt and its `n` samples, or a conversation's next turn) is admitted when the
  pool can hold its prompt's pages plus each sample's growth to its token limit (a reservation, so an admitted
  sequence never waits for memory); otherwise it waits in the queue.
- **Prefill once, share**: the prompt is prefilled once, in chunks of `prefill_chunk` tokens (several prompts per
  call); its `n` samples share the prompt's full pages (reference counts) and each gets its own copy of the
  last, partial page (copy on write) before writing into it.
- **Continuous batching**: `slots` sequences decode at once, `steps_per_call` tokens per device call; between
  calls the host appends the emitted tokens, releases the pages of finished sequences and fills free slots
  from the ready queue. A finished row never decodes again; a slot with nothing to do computes on padding.
- **Conversations**: with `keep=True` a finished sequence keeps its pages (`Conversation`); its next turn
  prefills only the new tokens (the environment's reply) after them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxrl_llm.engine.cpu_kernel as cpu_kernel
from jaxrl_llm.engine.allocator import PageAllocator
from jaxrl_llm.engine.kernels import attention_backend
from jaxrl_llm.engine.model import check_engine_context
from jaxrl_llm.engine.pages import PagedLayer, init_pages, table_width
from jaxrl_llm.engine.programs import (
    SamplingFlags,
    SlotState,
    copy_pages_program,
    decode_program,
    first_tokens_program,
    pack_weights,
    prefill_program,
    prepare_weights,
)
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling.config import SamplingConfig, knobs_from_config
from jaxrl_llm.sharding import fit_spec, global_array


@dataclasses.dataclass
class Conversation:
    """A finished sequence's context kept in the pool: every token so far (`tokens`; the last one sampled but not
    yet written), and the pages holding the first `written` of them."""

    tokens: list[int]
    pages: list[int]
    written: int
    experts: np.ndarray | None = None  # an MoE model's record of every written token's experts `[written, L, k]`


@dataclasses.dataclass
class Request:
    """`n` samples of `tokens` (a prompt; or, with `conversation`, the tokens that follow it), keyed by `key`
    (sample j draws with `fold_in(key, j)`), each up to `max_new_tokens`. `key`: a `jax.random.key`, or its key data
    (`uint32 [2]`, numpy: what `prompt_requests` passes, so many requests cost no device call each)."""

    tokens: list[int]
    key: jax.Array | np.ndarray
    n: int = 1
    max_new_tokens: int | None = None
    conversation: Conversation | None = None


@dataclasses.dataclass
class Completion:
    """One sample: its tokens, their log-probs (as sampled, and untruncated), whether it stopped on EOS, its
    conversation when kept, and for an MoE model the experts every token of its context was routed to as it was
    written (prefill and decode: `[context - 1, L, k]` int16, the last sampled token never being fed; with a
    conversation, from its first turn on), the record routing replay uses."""

    tokens: list[int]
    logprobs: list[float]
    untruncated: list[float]
    stopped_on_eos: bool
    conversation: Conversation | None = None
    experts: np.ndarray | None = None


@dataclasses.dataclass
class _Sequence:
    result: int  # index into the results
    key_data: np.ndarray  # [2] uint32
    context: list[int]  # every token so far, the last one sampled and not yet written
    pages: list[int]
    reserved: int  # pages still reserved for its growth
    remaining: int  # tokens it may still sample
    completion: Completion
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # MoE: records of its written tokens


@dataclasses.dataclass
class EngineStats:
    """Counters of the last `generate`: prompt tokens prefilled, decode calls, pages shared by forks, the pool's
    peak pages in use."""

    prefilled_tokens: int = 0
    decode_calls: int = 0
    shared_pages: int = 0
    peak_pages: int = 0


class Engine:
    """Generates with continuous batching over a paged KV cache of `num_pages` pages of `page_size` tokens.
    `attention`: the decode step's attention, `auto | xla | cpu | pallas` (`kernels.attention_backend`); with the
    CPU's kernel, a bfloat16 model on a CPU with AMX also decodes its matmuls on packed weights (`packed_matmul`,
    `cpu_kernel.packed_matmul`; set it False to keep XLA's). On a `mesh`
    (the weights placed on it by `jaxrl_llm.sharding`) the pool's KV heads are split over `tensor` and every
    device holds every page; a decode call's slots are split over `("data", "fsdp")`; the host schedules alike in
    every process, so the tokens do not depend on the mesh. An engine on several devices decodes on the XLA path (a
    mesh of one process runs one engine per data-parallel shard instead: `sharded.ShardedEngine`)."""

    def __init__(self, config: ModelConfig, *, num_pages: int, page_size: int = 16, slots: int = 32,
                 steps_per_call: int = 8, prefill_chunk: int = 128, prefill_rows: int = 32,
                 attention: str = "auto", mesh: Mesh | None = None) -> None:
        self.mesh = mesh
        several = mesh is not None and mesh.size > 1
        if several and attention == "pallas":
            raise ConfigError(f"sampling.engine_attention=pallas runs on one device; this sampler's mesh has "
                              f"{mesh.size}: use auto or xla")  # type: ignore[union-attr]
        self.attention = "xla" if several else attention_backend(config, attention)
        # The AMX matmul goes with the CPU kernels (`engine_attention=xla` turns both off), for bfloat16 models.
        self.packed_matmul = (self.attention == "cpu" and config.jnp_dtype == jnp.bfloat16
                              and cpu_kernel.packed_matmul_unavailable_reason() is None)
        self.config, self.page_size, self.slots = config, page_size, slots
        self.steps, self.chunk, self.prefill_rows = steps_per_call, prefill_chunk, prefill_rows
        self.allocator = PageAllocator(num_pages)
        self.pages: list[PagedLayer] = self._placed(lambda: init_pages(config, num_pages, page_size))
        self.stats = EngineStats()

    @property
    def num_pages(self) -> int:
        """The pages of the pool."""
        return self.allocator.num_pages

    def _placed(self, make: Any) -> Any:
        """`make()`'s arrays created in place on the mesh (the pool's placement), or as they are without one."""
        if self.mesh is None:
            return make()
        shapes = jax.eval_shape(make)
        shardings = jax.tree.map(lambda x: NamedSharding(self.mesh, fit_spec(PartitionSpec("tensor"), x.shape,
                                                                            self.mesh)), shapes)
        return jax.jit(make, out_shardings=shardings)()

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array as a program input: whole on every device of the mesh (every process holds it), or as is."""
        return jnp.asarray(x) if self.mesh is None else global_array(x, self.mesh, PartitionSpec())

    # ------------------------------------------------------------------------------------------- public

    def generate(self, params: Params, requests: list[Request], sampling: SamplingConfig, *,
                 keep: bool = False) -> list[list[Completion]]:
        """Every request's `n` completions, in request order. With `keep`, each completion holds its
        `Conversation` (its pages stay in the pool until `release`)."""
        self.stats = EngineStats()
        check_engine_context(self.config, max((len(r.conversation.tokens) if r.conversation else 0) + len(r.tokens)
                                              + self._max_new(r, sampling) for r in requests) if requests else 0)
        weights = prepare_weights(params, self.config, self.mesh)
        decode_weights = pack_weights(params, weights, config=self.config) if self.packed_matmul else weights
        head = decode_weights.head if self.packed_matmul else None  # the packed LM head serves the prefill too
        knobs = knobs_from_config(sampling)
        flags = SamplingFlags(sampling.greedy, sampling.uses_top_k, sampling.uses_top_p, sampling.uses_min_p,
                              tuple(sampling.eos_ids), sampling.pad_id)
        results: list[list[Completion]] = [[] for _ in requests]
        queue = collections.deque(range(len(requests)))
        ready: collections.deque[_Sequence] = collections.deque()
        slots: list[_Sequence | None] = [None] * self.slots
        while queue or ready or any(s is not None for s in slots):
            admitted, waiting = [], len(ready) + sum(s is not None for s in slots)
            while waiting < self.slots:  # prefill until the slots have work (or the pool or the queue runs out)
                batch = self._admit(requests, queue, waiting, sampling)
                if not batch:
                    break
                admitted += batch
                ready.extend(self._prefill(params, weights, head, requests, batch, sampling, knobs, flags, results,
                                           keep))
                waiting = len(ready) + sum(s is not None for s in slots)
            for i in range(self.slots):
                if slots[i] is None and ready:
                    slots[i] = ready.popleft()
            if any(s is not None for s in slots):
                self._decode(params, decode_weights, slots, knobs, flags, keep)
            elif not admitted and queue:
                need = self._pages_needed(requests[queue[0]], sampling)
                raise RuntimeError(f"the rollout engine's pool ({self.allocator.num_pages} pages of "
                                   f"{self.page_size}) cannot hold one request ({need} pages); raise "
                                   "sampling.engine_pages")
        return results

    def release(self, conversation: Conversation) -> None:
        """Give a kept conversation's pages back to the pool."""
        self.allocator.release(conversation.pages)
        conversation.pages = []

    # ------------------------------------------------------------------------------------------ admission

    @staticmethod
    def _key_data(keys: list[Any]) -> np.ndarray:
        """Requests' keys as key data `[R, 2]` uint32: typed keys converted in one call, key data as it is."""
        if all(isinstance(k, np.ndarray) for k in keys):
            return np.stack(keys).astype(np.uint32)
        typed = [jax.random.wrap_key_data(jnp.asarray(k, jnp.uint32)) if isinstance(k, np.ndarray) else k
                 for k in keys]
        return host_array(jax.random.key_data(jnp.stack(typed)))

    def _max_new(self, request: Request, sampling: SamplingConfig) -> int:
        return request.max_new_tokens or sampling.max_new_tokens

    def _pages_needed(self, request: Request, sampling: SamplingConfig) -> int:
        """Pages to reserve for a request: each sample holds positions up to `context + max_new - 2` (the last
        sampled token is never written). A group's samples share the prompt's full pages; each owns the rest
        (its copy of the partial last page included), and the prompt's own partial page lives until the fork."""
        ps, conv, m = self.page_size, request.conversation, self._max_new(request, sampling)
        if conv is not None:
            context = len(conv.tokens) + len(request.tokens)
            return max(0, math.ceil((context + m - 1) / ps) - len(conv.pages))
        p = len(request.tokens)
        per_sample = math.ceil((p + m - 1) / ps)
        if request.n == 1:
            return per_sample
        full = p // ps
        return full + (1 if p % ps else 0) + request.n * (per_sample - full)

    def _admit(self, requests: list[Request], queue: collections.deque, waiting: int,
               sampling: SamplingConfig) -> list[int]:
        """Requests taken from the queue for prefill: while the pool can hold them, up to a prefill call's token
        budget (`prefill_rows * prefill_chunk`; short requests such as an environment's reply fill it with more rows),
        and only while fewer than two slot-fulls of samples wait for a slot."""
        admitted: list[int] = []
        budget, tokens = self.prefill_rows * self.chunk, 0
        while queue and waiting < 2 * self.slots:
            new = len(requests[queue[0]].tokens) + 1  # a conversation's turn also writes its last sampled token
            if admitted and (tokens + new > budget or len(admitted) >= budget // min(self.chunk, 16)):
                break
            need = self._pages_needed(requests[queue[0]], sampling)
            if need > self.allocator.available():
                break
            self.allocator.reserve(need)
            admitted.append(queue.popleft())
            tokens, waiting = tokens + new, waiting + requests[admitted[-1]].n
        return admitted

    # -------------------------------------------------------------------------------------------- prefill

    def _prefill(self, params: Params, weights: Any, head: jax.Array | None, requests: list[Request],
                 admitted: list[int], sampling: SamplingConfig, knobs: Any, flags: SamplingFlags,
                 results: list[list[Completion]], keep: bool) -> list[_Sequence]:
        """Prefill the admitted requests' new tokens (chunked, `prefill_rows` rows per call), then fork each into
        its samples with their first token. Returns the samples that still decode."""
        ps, alloc = self.page_size, self.allocator
        rows = []  # (tokens to write, first position, pages)
        for r in admitted:
            req, conv = requests[r], requests[r].conversation
            if conv is not None:
                if req.n != 1:
                    raise ValueError("a conversation's next turn takes n=1")
                tokens, start, pages = conv.tokens[conv.written:] + list(req.tokens), conv.written, list(conv.pages)
                conv.pages = []  # its pages now belong to the new turn's sequence
            else:
                if not req.tokens:
                    raise ValueError(f"request {r} has an empty prompt")
                tokens, start, pages = list(req.tokens), 0, []
            pages += alloc.allocate(math.ceil((start + len(tokens)) / ps) - len(pages), reserved=True)
            rows.append((tokens, start, pages))
        logits, experts = self._run_prefill(params, weights, head, rows)
        # Every sample's key (`fold_in(request key, j)`) and first token in one call, from its prompt's last logits.
        counts = [requests[r].n for r in admitted]
        total = sum(counts)
        width = _pow2(total)
        picks = logits[np.repeat(np.arange(len(counts)), counts)]  # each sample's row: its prompt's logits
        parents = np.repeat(self._key_data([requests[r].key for r in admitted]), counts, axis=0)
        sample = np.concatenate([np.arange(n) for n in counts]).astype(np.int32)
        keys, first = first_tokens_program(np.pad(picks, ((0, width - total), (0, 0))),
                                           np.pad(parents, ((0, width - total), (0, 0))),
                                           np.pad(sample, (0, width - total)), knobs, flags=flags)
        keys, first = np.asarray(keys)[:total], [np.asarray(a)[:total] for a in first]
        out, copies, offset = [], [], 0
        for (tokens, start, pages), r, n, written in zip(rows, admitted, counts, experts, strict=True):
            drawn = tuple(a[offset:offset + n] for a in first)
            out += self._fork(requests[r], r, tokens, start, pages, keys[offset:offset + n], drawn, sampling, flags,
                              results, keep, copies, written)
            offset += n
        if copies:  # the partial pages the samples write after: one call, padded with no-op copies of page 0
            width = _pow2(len(copies))
            source, target = np.zeros((width,), np.int32), np.zeros((width,), np.int32)
            source[:len(copies)], target[:len(copies)] = zip(*copies, strict=True)
            self.pages = copy_pages_program(self.pages, self._put(source), self._put(target))
        self.stats.peak_pages = max(self.stats.peak_pages, alloc.in_use())
        return out

    def _run_prefill(self, params: Params, weights: Any, head: jax.Array | None,
                     rows: list[tuple[list[int], int, list[int]]]) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """The prefill calls for `rows` (chunks of up to `prefill_chunk` tokens, as many rows a call as fill
        `prefill_rows` full chunks: short rows, many at once): each row's last logits, `[len(rows), V]` (on the host:
        the samples' first tokens are drawn from them), and for an MoE model each row's written tokens' experts
        `[tokens, L, k]` (else None per row)."""
        groups: list[np.ndarray] = []
        records: list[list[np.ndarray]] = [[] for _ in rows]
        c = min(self.chunk, _round16(max(len(tokens) for tokens, _, _ in rows)))  # short prompts: short chunks
        per_call = max(1, self.prefill_rows * self.chunk // c)
        for g in range(0, len(rows), per_call):
            group = rows[g:g + per_call]
            width = min(per_call, _pow2(len(group)))  # a few prompts: a small call
            table = np.zeros((width, _pow2(max(len(pages) for _, _, pages in group))), np.int32)
            for i, (_, _, pages) in enumerate(group):
                table[i, :len(pages)] = pages
            group_logits = None
            for k in range(max(math.ceil(len(tokens) / c) for tokens, _, _ in group)):
                # The last chunk only as wide as the longest remainder (a 140-token prompt: 128 + 16 columns).
                cols = min(c, _round16(max(len(tokens) - k * c for tokens, _, _ in group)))
                tok = np.zeros((width, cols), np.int32)
                pos = np.full((width, cols), -1, np.int32)
                last = np.zeros((width,), np.int32)
                ends = np.zeros((width,), bool)  # rows whose last token is in this chunk
                for i, (tokens, start, _) in enumerate(group):
                    part = tokens[k * c:(k + 1) * c]
                    tok[i, :len(part)] = part
                    pos[i, :len(part)] = start + k * c + np.arange(len(part))
                    last[i], ends[i] = max(len(part) - 1, 0), (k + 1) * c >= len(tokens) > k * c
                    self.stats.prefilled_tokens += len(part)
                out, self.pages, chosen = prefill_program(params, weights, self.pages,
                                                          *map(self._put, (tok, pos, table, last)),
                                                          config=self.config, attention=self.attention,
                                                          mesh=self.mesh, head=head)
                out = host_array(out)
                if chosen is not None:
                    chosen = host_array(chosen)
                    for i, (tokens, _, _) in enumerate(group):
                        records[g + i].append(chosen[i, :len(tokens[k * c:(k + 1) * c])])
                group_logits = out if group_logits is None else np.where(ends[:, None], out, group_logits)
            groups.append(group_logits[:len(group)])  # type: ignore[index]
        return np.concatenate(groups), [np.concatenate(r) if r else None for r in records]

    def _fork(self, req: Request, r: int, tokens: list[int], start: int, pages: list[int], keys: np.ndarray,
              first: tuple[np.ndarray, ...], sampling: SamplingConfig, flags: SamplingFlags,
              results: list[list[Completion]], keep: bool, copies: list[tuple[int, int]],
              written: np.ndarray | None = None) -> list[_Sequence]:
        """The request's `n` samples after its prefill, with their first tokens `first` (tokens, log-probs,
        untruncated): page tables (shared full pages; own pages for the partial last one, whose copies are added to
        `copies`), and the samples still to decode. `written`: an MoE model's experts of the prefilled tokens."""
        ps, alloc, n = self.page_size, self.allocator, req.n
        context = (req.conversation.tokens[:start] if req.conversation else []) + tokens
        m = self._max_new(req, sampling)
        per_sample = math.ceil((len(context) + m - 1) / ps)
        if n == 1:
            tables = [pages]
        else:
            full, partial = pages[:len(context) // ps], pages[len(context) // ps:]
            tables = []
            for _ in range(n):
                alloc.share(full)
                own = alloc.allocate(len(partial), reserved=True)
                tables.append(full + own)
                copies += list(zip(partial, own, strict=True))
            self.stats.shared_pages += len(full) * (n - 1)
            alloc.release(pages)  # the prefill's own references: the samples hold theirs
        out = []
        for j in range(n):
            token = int(first[0][j])
            completion = Completion([token], [float(first[1][j])], [float(first[2][j])], False)
            results[r].append(completion)
            seq = _Sequence(r, keys[j], context + [token], tables[j], per_sample - len(tables[j]), m - 1, completion)
            if written is not None:  # the conversation's earlier records, then this prefill's
                earlier = req.conversation.experts if req.conversation is not None else None
                seq.experts = ([earlier[:start]] if earlier is not None else []) + [written]
            if token in flags.eos_ids or m == 1:
                completion.stopped_on_eos = token in flags.eos_ids
                self._finish(seq, keep)
            else:
                out.append(seq)
        return out

    # --------------------------------------------------------------------------------------------- decode

    def _decode(self, params: Params, weights: Any, slots: list[_Sequence | None], knobs: Any,
                flags: SamplingFlags, keep: bool) -> None:
        """One decode call: pages for the next `steps_per_call` positions of every slot, the call, then each
        slot's emitted tokens appended; finished sequences leave their slot."""
        ps, alloc, steps = self.page_size, self.allocator, self.steps
        for seq in slots:
            if seq is not None:
                written_to = len(seq.context) - 1 + min(steps, seq.remaining)  # positions written by this call
                grow = math.ceil(written_to / ps) - len(seq.pages)
                if grow > 0:
                    seq.pages += alloc.allocate(grow, reserved=True)
                    seq.reserved -= grow
        self.stats.peak_pages = max(self.stats.peak_pages, alloc.in_use())
        # The call runs only the occupied slots, packed into `decode_rows` of them: as rows finish the batch
        # shrinks, and no finished row is computed on. Page tables are cut at a multiple of 128 tokens past the
        # longest row, so attention reads the context the rows have, not the longest a row may reach.
        occupied = [i for i, seq in enumerate(slots) if seq is not None]
        count = decode_rows(len(occupied), self.slots)
        m = table_width(max(len(slots[i].pages) for i in occupied), ps)  # type: ignore[union-attr]
        table = np.zeros((count, m), np.int32)
        token, position = np.zeros((count,), np.int32), np.zeros((count,), np.int32)
        key_data, index = np.zeros((count, 2), np.uint32), np.zeros((count,), np.int32)
        remaining, active = np.zeros((count,), np.int32), np.zeros((count,), bool)
        for row, i in enumerate(occupied):
            seq = slots[i]
            assert seq is not None
            table[row, :len(seq.pages)] = seq.pages
            token[row], position[row] = seq.context[-1], len(seq.context) - 1
            key_data[row], index[row] = seq.key_data, len(seq.completion.tokens)
            remaining[row], active[row] = seq.remaining, True
        state = SlotState(*map(self._put, (token, position, table, key_data, index, remaining, active)))
        state, out, self.pages = decode_program(params, weights, self.pages, state, knobs, config=self.config,
                                                flags=flags, steps=steps, attention=self.attention, mesh=self.mesh)
        self.stats.decode_calls += 1
        new_index, still = host_array(state.index), host_array(state.active)
        tokens, logprobs, untruncated, hit_eos = (host_array(x) for x in out[:4])
        chosen = None if out.experts is None else host_array(out.experts)
        for row, i in enumerate(occupied):
            seq = slots[i]
            assert seq is not None
            emitted = int(new_index[row] - index[row])
            seq.context += tokens[row, :emitted].tolist()
            seq.completion.tokens += tokens[row, :emitted].tolist()
            seq.completion.logprobs += logprobs[row, :emitted].tolist()
            seq.completion.untruncated += untruncated[row, :emitted].tolist()
            if chosen is not None:  # the experts of the tokens this call fed
                seq.experts.append(chosen[row, :emitted])
            seq.remaining -= emitted
            if not still[row]:
                seq.completion.stopped_on_eos = bool(hit_eos[row])
                self._finish(seq, keep)
                slots[i] = None

    def _finish(self, seq: _Sequence, keep: bool) -> None:
        """A finished sample: its unused reservation back; its pages kept as its conversation, or released."""
        self.allocator.unreserve(seq.reserved)
        seq.reserved = 0
        if seq.experts:
            seq.completion.experts = np.concatenate(seq.experts)
        if keep:
            seq.completion.conversation = Conversation(seq.context, seq.pages, len(seq.context) - 1,
                                                       seq.completion.experts)
        else:
            self.allocator.release(seq.pages)
        seq.pages = []


def host_array(x: jax.Array) -> np.ndarray:
    """An array that is whole on every device (a program's output; a run's key) on the host: one addressable copy
    is all of it, also when other processes hold the rest of the mesh."""
    return np.asarray(x) if x.is_fully_addressable else np.asarray(x.addressable_data(0))


def _round16(n: int) -> int:
    """`n` rounded up to a multiple of 16 (at least 16): a prefill chunk's width, so few program shapes compile
    while a 43-token prompt computes 48 columns, not 64."""
    return max(16, -(-n // 16) * 16)


def decode_rows(occupied: int, slots: int) -> int:
    """The rows a decode call computes for `occupied` sequences in `slots` slots: the next power of two (at least
    an eighth of the slots), and above half the slots the next multiple of a quarter where that is at least 16
    rows (the AMX matmul's row blocks are 16 and 32). A GRPO rollout keeps most of its rows to the token limit, so
    its batch spends the second half of the steps between 3/4 and all of the slots: 96 of 128 rows then cost a
    quarter less than 128 (bench/README.md). Few distinct counts, so few programs compile."""
    count = min(slots, max(_pow2(occupied), slots // 8))
    quarter = slots // 4
    if count > slots // 2 and quarter >= 16:
        count = min(slots, -(-occupied // quarter) * quarter)
    return count


def _pow2(n: int) -> int:
    """`n` rounded up to a power of two (at least 4), so few program shapes compile."""
    return max(4, 1 << max(0, n - 1).bit_length())
