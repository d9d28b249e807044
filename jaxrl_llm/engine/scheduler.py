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

`Engine` is this loop; the pool and the device programs are its `Runner` (`runner.py`); the arithmetic of pages,
prefill chunks and decode batches are the module's functions, each testable alone.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.engine.allocator import PageAllocator
from jaxrl_llm.engine.model import check_engine_context
from jaxrl_llm.engine.pages import PagedLayer, table_width
from jaxrl_llm.engine.programs import SamplingFlags, SlotState, first_tokens_program
from jaxrl_llm.engine.requests import Completion, Conversation, EngineStats, Request, Sequence
from jaxrl_llm.engine.runner import CallWeights, Runner, host_array
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import Params
from jaxrl_llm.sampling.config import SamplingConfig, knobs_from_config

__all__ = ["Completion", "Conversation", "Engine", "EngineStats", "Request", "decode_rows", "host_array"]

Row = tuple[list[int], int, list[int]]  # a prefill row: the tokens to write, their first position, the pages


class Engine:
    """Generates with continuous batching over a paged KV cache of `num_pages` pages of `page_size` tokens (its
    `Runner`: the pool and the programs; `attention`: `auto | xla | cpu | pallas`, and with the CPU's kernel a
    bfloat16 model on a CPU with AMX decodes its matmuls on packed weights, `packed_matmul`). On a `mesh` the
    pool's KV heads are split over `tensor` and every device holds every page; the host schedules alike in every
    process, so the tokens do not depend on the mesh. An engine on several devices decodes on the XLA path (a mesh of
    one process runs one engine per data-parallel shard instead: `sharded.ShardedEngine`)."""

    def __init__(self, config: ModelConfig, *, num_pages: int, page_size: int = 16, slots: int = 32,
                 steps_per_call: int = 8, prefill_chunk: int = 128, prefill_rows: int = 32,
                 attention: str = "auto", mesh: Mesh | None = None) -> None:
        self.runner = Runner(config, num_pages=num_pages, page_size=page_size, attention=attention, mesh=mesh)
        self.config, self.mesh, self.page_size, self.slots = config, mesh, page_size, slots
        self.attention, self.packed_matmul = self.runner.attention, self.runner.packed_matmul
        self.steps, self.chunk, self.prefill_rows = steps_per_call, prefill_chunk, prefill_rows
        self.allocator = PageAllocator(num_pages)
        self.stats = EngineStats()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def pages(self) -> list[PagedLayer]:
        """The pool's arrays (the runner's)."""
        return self.runner.pages

    def generate(self, params: Params, requests: list[Request], sampling: SamplingConfig, *,
                 keep: bool = False) -> list[list[Completion]]:
        """Every request's `n` completions, in request order. With `keep`, each completion holds its
        `Conversation` (its pages stay in the pool until `release`)."""
        self.stats = EngineStats()
        check_engine_context(self.config, max((len(r.conversation.tokens) if r.conversation else 0) + len(r.tokens)
                                              + max_new(r, sampling) for r in requests) if requests else 0)
        weights = self.runner.weights(params)
        flags = SamplingFlags(sampling.greedy, sampling.uses_top_k, sampling.uses_top_p, sampling.uses_min_p,
                              tuple(sampling.eos_ids), sampling.pad_id)
        call = (params, weights, knobs_from_config(sampling), flags, keep)
        results: list[list[Completion]] = [[] for _ in requests]
        queue, ready = collections.deque(range(len(requests))), collections.deque[Sequence]()
        slots: list[Sequence | None] = [None] * self.slots
        while queue or ready or any(s is not None for s in slots):
            admitted, waiting = [], len(ready) + sum(s is not None for s in slots)
            while waiting < self.slots:  # prefill until the slots have work (or the pool or the queue runs out)
                batch = admit(requests, queue, waiting, sampling, self.allocator, slots=self.slots,
                              budget=self.prefill_rows * self.chunk, chunk=self.chunk, page_size=self.page_size)
                if not batch:
                    break
                admitted += batch
                ready.extend(self._prefill(call, requests, batch, sampling, results))
                waiting = len(ready) + sum(s is not None for s in slots)
            for i in range(self.slots):
                if slots[i] is None and ready:
                    slots[i] = ready.popleft()
            if any(s is not None for s in slots):
                self._decode(call, slots)
            elif not admitted and queue:
                need = pages_needed(requests[queue[0]], max_new(requests[queue[0]], sampling), self.page_size)
                raise RuntimeError(f"the rollout engine's pool ({self.allocator.num_pages} pages of "
                                   f"{self.page_size}) cannot hold one request ({need} pages); raise "
                                   "sampling.engine_pages")
        return results

    def release(self, conversation: Conversation) -> None:
        """Give a kept conversation's pages back to the pool."""
        self.allocator.release(conversation.pages)
        conversation.pages = []

    def _prefill(self, call: tuple, requests: list[Request], admitted: list[int], sampling: SamplingConfig,
                 results: list[list[Completion]]) -> list[Sequence]:
        """Prefill the admitted requests' new tokens (chunked, `prefill_rows` rows per call), then fork each into
        its samples with their first token. Returns the samples that still decode."""
        params, weights, knobs, flags, keep = call
        rows = [prefill_row(requests[r], r, self.allocator, self.page_size) for r in admitted]
        logits, experts, prefilled = run_prefill(self.runner, params, weights, rows, self.chunk, self.prefill_rows)
        self.stats.prefilled_tokens += prefilled
        counts = [requests[r].n for r in admitted]
        keys, first = first_tokens(logits, [requests[r].key for r in admitted], counts, knobs, flags)
        out, copies, offset = [], [], 0
        for (tokens, start, pages), r, n, written in zip(rows, admitted, counts, experts, strict=True):
            samples = fork(requests[r], r, (tokens, start, pages), keys[offset:offset + n],
                           tuple(a[offset:offset + n] for a in first), max_new(requests[r], sampling), self.allocator,
                           self.page_size, copies, written)
            self.stats.shared_pages += (start + len(tokens)) // self.page_size * (n - 1)  # the full pages, shared
            for seq in samples:
                results[r].append(seq.completion)
                if seq.completion.tokens[-1] in flags.eos_ids or seq.remaining == 0:
                    seq.completion.stopped_on_eos = seq.completion.tokens[-1] in flags.eos_ids
                    finish(seq, keep, self.allocator)
                else:
                    out.append(seq)
            offset += n
        if copies:  # the partial pages the samples write after: one call, padded with no-op copies of page 0
            self.runner.copy(copies, _pow2(len(copies)))
        self.stats.peak_pages = max(self.stats.peak_pages, self.allocator.in_use())
        return out

    def _decode(self, call: tuple, slots: list[Sequence | None]) -> None:
        """One decode call: pages for the next `steps_per_call` positions of every slot, the call, then each
        slot's emitted tokens appended; finished sequences leave their slot."""
        params, weights, knobs, flags, keep = call
        for seq in slots:
            if seq is not None:
                grow_pages(seq, self.allocator, self.page_size, self.steps)
        self.stats.peak_pages = max(self.stats.peak_pages, self.allocator.in_use())
        occupied = [i for i, seq in enumerate(slots) if seq is not None]
        state = decode_batch([slots[i] for i in occupied], decode_rows(len(occupied), self.slots),  # type: ignore
                             self.page_size)
        new_index, still, out = self.runner.decode(params, weights, state, knobs, flags, self.steps)
        self.stats.decode_calls += 1
        for row, i in enumerate(occupied):
            seq = slots[i]
            assert seq is not None
            take_emitted(seq, out, row, int(new_index[row] - state.index[row]))
            if not still[row]:
                seq.completion.stopped_on_eos = bool(out.hit_eos[row])
                finish(seq, keep, self.allocator)
                slots[i] = None

# ------------------------------------------------------------------------------------- the host's arithmetic


def admit(requests: list[Request], queue: collections.deque, waiting: int, sampling: SamplingConfig,
          allocator: PageAllocator, *, slots: int, budget: int, chunk: int, page_size: int) -> list[int]:
    """Requests taken from the queue for prefill (their pages reserved): while the pool can hold them, up to a
    prefill call's token `budget` (short requests such as an environment's reply fill it with more rows), and only
    while fewer than two slot-fulls of samples wait for a slot (`waiting` now)."""
    admitted: list[int] = []
    tokens = 0
    while queue and waiting < 2 * slots:
        new = len(requests[queue[0]].tokens) + 1  # a conversation's turn also writes its last sampled token
        if admitted and (tokens + new > budget or len(admitted) >= budget // min(chunk, 16)):
            break
        need = pages_needed(requests[queue[0]], max_new(requests[queue[0]], sampling), page_size)
        if need > allocator.available():
            break
        allocator.reserve(need)
        admitted.append(queue.popleft())
        tokens, waiting = tokens + new, waiting + requests[admitted[-1]].n
    return admitted


def run_prefill(runner: Runner, params: Params, weights: CallWeights, rows: list[Row], chunk: int,
                prefill_rows: int) -> tuple[np.ndarray, list[np.ndarray | None], int]:
    """The prefill calls for `rows` (`prefill_calls`): each row's last logits `[len(rows), V]` (on the host: the
    samples' first tokens are drawn from them), for an MoE model each row's written tokens' experts (else None), and
    the tokens prefilled."""
    records: list[list[np.ndarray]] = [[] for _ in rows]
    logits, prefilled = None, 0
    for first, lengths, arrays, ends in prefill_calls(rows, chunk, prefill_rows):
        out, chosen = runner.prefill(params, weights, *arrays)
        logits = np.zeros((len(rows), out.shape[-1]), np.float32) if logits is None else logits
        prefilled += sum(lengths)
        for i, length in enumerate(lengths):
            if chosen is not None and length:
                records[first + i].append(chosen[i, :length])
            if ends[i]:
                logits[first + i] = out[i]
    return logits, [np.concatenate(r) if r else None for r in records], prefilled  # type: ignore[return-value]


def finish(seq: Sequence, keep: bool, allocator: PageAllocator) -> None:
    """A finished sample: its unused reservation back; its pages kept as its conversation, or released."""
    allocator.unreserve(seq.reserved)
    seq.reserved = 0
    if seq.experts:
        seq.completion.experts = np.concatenate(seq.experts)
    if keep:
        seq.completion.conversation = Conversation(seq.context, seq.pages, len(seq.context) - 1, seq.completion.experts)
    else:
        allocator.release(seq.pages)
    seq.pages = []


def max_new(request: Request, sampling: SamplingConfig) -> int:
    """The request's token limit (its own, else the call's)."""
    return request.max_new_tokens or sampling.max_new_tokens


def pages_needed(request: Request, limit: int, page_size: int) -> int:
    """Pages to reserve for a request of token limit `limit`: each sample holds positions up to `context + limit - 2`
    (the last sampled token is never written). A group's samples share the prompt's full pages; each owns the rest
    (its copy of the partial last page included), and the prompt's own partial page lives until the fork."""
    ps, conv = page_size, request.conversation
    if conv is not None:
        context = len(conv.tokens) + len(request.tokens)
        return max(0, math.ceil((context + limit - 1) / ps) - len(conv.pages))
    p = len(request.tokens)
    per_sample = math.ceil((p + limit - 1) / ps)
    if request.n == 1:
        return per_sample
    full = p // ps
    return full + (1 if p % ps else 0) + request.n * (per_sample - full)


def key_data(keys: list[Any]) -> np.ndarray:
    """Requests' keys as key data `[R, 2]` uint32: typed keys converted in one call, key data as it is."""
    if all(isinstance(k, np.ndarray) for k in keys):
        return np.stack(keys).astype(np.uint32)
    typed = [jax.random.wrap_key_data(jnp.asarray(k, jnp.uint32)) if isinstance(k, np.ndarray) else k for k in keys]
    return host_array(jax.random.key_data(jnp.stack(typed)))


def prefill_row(request: Request, r: int, allocator: PageAllocator, page_size: int) -> Row:
    """An admitted request's prefill row: its new tokens, their first position and its pages (a conversation's,
    which the new turn takes over, plus the new ones from its reservation)."""
    conv = request.conversation
    if conv is not None:
        if request.n != 1:
            raise ValueError("a conversation's next turn takes n=1")
        tokens, start, pages = conv.tokens[conv.written:] + list(request.tokens), conv.written, list(conv.pages)
        conv.pages = []  # its pages now belong to the new turn's sequence
    else:
        if not request.tokens:
            raise ValueError(f"request {r} has an empty prompt")
        tokens, start, pages = list(request.tokens), 0, []
    pages += allocator.allocate(math.ceil((start + len(tokens)) / page_size) - len(pages), reserved=True)
    return tokens, start, pages


def prefill_calls(rows: list[Row], chunk: int, prefill_rows: int
                  ) -> Iterator[tuple[int, list[int], tuple[np.ndarray, ...], np.ndarray]]:
    """The prefill calls for `rows`: chunks of up to `chunk` tokens (narrower for short prompts), as many rows a call
    as fill `prefill_rows` full chunks. Yields `(first row, each row's tokens in this chunk, (tokens, positions, page
    table, last column) arrays, whether each row's last token is in this chunk)`."""
    c = min(chunk, _round16(max(len(tokens) for tokens, _, _ in rows)))  # short prompts: short chunks
    per_call = max(1, prefill_rows * chunk // c)
    for g in range(0, len(rows), per_call):
        group = rows[g:g + per_call]
        width = min(per_call, _pow2(len(group)))  # a few prompts: a small call
        table = np.zeros((width, _pow2(max(len(pages) for _, _, pages in group))), np.int32)
        for i, (_, _, pages) in enumerate(group):
            table[i, :len(pages)] = pages
        for k in range(max(math.ceil(len(tokens) / c) for tokens, _, _ in group)):
            # The last chunk only as wide as the longest remainder (a 140-token prompt: 128 + 16 columns).
            cols = min(c, _round16(max(len(tokens) - k * c for tokens, _, _ in group)))
            tok, pos = np.zeros((width, cols), np.int32), np.full((width, cols), -1, np.int32)
            last, ends, lengths = np.zeros((width,), np.int32), np.zeros((width,), bool), []
            for i, (tokens, start, _) in enumerate(group):
                part = tokens[k * c:(k + 1) * c]
                tok[i, :len(part)] = part
                pos[i, :len(part)] = start + k * c + np.arange(len(part))
                last[i], ends[i] = max(len(part) - 1, 0), (k + 1) * c >= len(tokens) > k * c
                lengths.append(len(part))
            yield g, lengths, (tok, pos, table, last), ends


def first_tokens(logits: np.ndarray, keys: list[Any], counts: list[int], knobs: Any, flags: SamplingFlags
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Every sample's key (`fold_in(request key, j)`) and first token (token, log-prob, untruncated), in one call,
    from its prompt's last logits (`logits [requests, V]`, `counts` samples each)."""
    total = sum(counts)
    width = _pow2(total)
    picks = logits[np.repeat(np.arange(len(counts)), counts)]  # each sample's row: its prompt's logits
    parents = np.repeat(key_data(keys), counts, axis=0)
    sample = np.concatenate([np.arange(n) for n in counts]).astype(np.int32)
    out_keys, first = first_tokens_program(np.pad(picks, ((0, width - total), (0, 0))),
                                           np.pad(parents, ((0, width - total), (0, 0))),
                                           np.pad(sample, (0, width - total)), knobs, flags=flags)
    return np.asarray(out_keys)[:total], [np.asarray(a)[:total] for a in first]


def fork(req: Request, r: int, row: Row, keys: np.ndarray, first: tuple[np.ndarray, ...], limit: int,
         allocator: PageAllocator, page_size: int, copies: list[tuple[int, int]],
         written: np.ndarray | None = None) -> list[Sequence]:
    """The request's `n` samples after its prefill, with their first tokens `first` (tokens, log-probs,
    untruncated): page tables (shared full pages; own pages for the partial last one, whose copies are added to
    `copies`). `written`: an MoE model's experts of the prefilled tokens."""
    tokens, start, pages = row
    ps, n = page_size, req.n
    context = (req.conversation.tokens[:start] if req.conversation else []) + tokens
    per_sample = math.ceil((len(context) + limit - 1) / ps)
    if n == 1:
        tables = [pages]
    else:
        full, partial = pages[:len(context) // ps], pages[len(context) // ps:]
        tables = []
        for _ in range(n):
            allocator.share(full)
            own = allocator.allocate(len(partial), reserved=True)
            tables.append(full + own)
            copies += list(zip(partial, own, strict=True))
        allocator.release(pages)  # the prefill's own references: the samples hold theirs
    out = []
    for j in range(n):
        token = int(first[0][j])
        completion = Completion([token], [float(first[1][j])], [float(first[2][j])], False)
        seq = Sequence(r, keys[j], context + [token], tables[j], per_sample - len(tables[j]), limit - 1, completion)
        if written is not None:  # the conversation's earlier records, then this prefill's
            earlier = req.conversation.experts if req.conversation is not None else None
            seq.experts = ([earlier[:start]] if earlier is not None else []) + [written]
        out.append(seq)
    return out


def grow_pages(seq: Sequence, allocator: PageAllocator, page_size: int, steps: int) -> None:
    """The pages a sample needs for the positions the next decode call writes (from its reservation)."""
    written_to = len(seq.context) - 1 + min(steps, seq.remaining)
    grow = math.ceil(written_to / page_size) - len(seq.pages)
    if grow > 0:
        seq.pages += allocator.allocate(grow, reserved=True)
        seq.reserved -= grow


def decode_batch(seqs: list[Sequence], count: int, page_size: int) -> SlotState:
    """A decode call's slots (numpy): the occupied slots' sequences packed into `count` rows, page tables cut at a
    multiple of 128 tokens past the longest row (attention reads the context the rows have)."""
    m = table_width(max(len(seq.pages) for seq in seqs), page_size)
    table = np.zeros((count, m), np.int32)
    token, position = np.zeros((count,), np.int32), np.zeros((count,), np.int32)
    keys, index = np.zeros((count, 2), np.uint32), np.zeros((count,), np.int32)
    remaining, active = np.zeros((count,), np.int32), np.zeros((count,), bool)
    for row, seq in enumerate(seqs):
        table[row, :len(seq.pages)] = seq.pages
        token[row], position[row] = seq.context[-1], len(seq.context) - 1
        keys[row], index[row] = seq.key_data, len(seq.completion.tokens)
        remaining[row], active[row] = seq.remaining, True
    return SlotState(token, position, table, keys, index, remaining, active)


def take_emitted(seq: Sequence, out: Any, row: int, emitted: int) -> None:
    """Append what a decode call emitted for `row` (`emitted` tokens of `StepOutputs` on the host) to `seq`."""
    tokens = out.tokens[row, :emitted].tolist()
    seq.context += tokens
    seq.completion.tokens += tokens
    seq.completion.logprobs += out.logprobs[row, :emitted].tolist()
    seq.completion.untruncated += out.untruncated[row, :emitted].tolist()
    if out.experts is not None:  # the experts of the tokens this call fed
        seq.experts.append(out.experts[row, :emitted])
    seq.remaining -= emitted


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
