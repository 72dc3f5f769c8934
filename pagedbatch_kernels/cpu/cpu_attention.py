"""The CPU engine's paged attention: decodes through kernels that read K/V where they lie in the pool,
prompts through `cpu_prefill`.

The reference gathers each decode's context out of the pool (`index_select`) and then lays it out
again for a batched matmul, at every layer: two copies of every context per step. The decode kernel
loads each key and value from its block directly: our C++ one (`cpu_native`) where it can be built,
else `decode_attention` compiled by inductor (`pagedbatch_kernels.compiled`) into a few fused loops. Decodes
whose block tables start with the same blocks (a shared system prompt, sibling samples) read those
blocks once for the whole group, every member's queries at once (`cpu_prefix`), and only their own
tails through the kernel; the two partial results merge by their log-sum-exp. Which decode goes in
which call is planned once per step (`DecodePlan`) and reused by every layer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_chunks import Chunk, ChunkBatch, chunk_attention, plan_chunks
from pagedbatch_kernels.cpu.cpu_decode import (
    _merge,
    decode_kernel,
)
from pagedbatch_kernels.cpu.cpu_prefill import prefill_attention
from pagedbatch_kernels.cpu.cpu_prefix import grouped_prefix_attention, plan_for, prefix_kernel
from pagedbatch_kernels.cpu.cpu_window import banded_attention

MIN_SAVING = 0.25  # a decode group is split where that saves this share of its padded work
MAX_GROUPS = 4
# Chunks of up to this many new tokens go through the decode kernels, a row per token (a prompt's
# tail after a cached prefix, say); longer ones through flash SDPA, one sequence at a time.
SHORT_CHUNK = 64
# A group of rows sharing prefix blocks takes them apart only where that spares this many position reads
# ((rows - 1) x shared positions): about what a group's own calls cost at every layer.
MIN_SHARED_READS = 128
MIN_CHUNK_ROWS = 2  # single decodes stay with the kernel: as bmm per row they ran ~1.5x slower


@dataclass
class KernelPart:
    """Some rows of a decode call through the kernel: their positions in the call (a row repeated
    where there is only one), how many are real, their block tables and context lengths."""

    rows: torch.Tensor
    count: int
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass
class DecodeCall:
    """One kernel call over some of a step's decodes: their query rows (None: every row of the step, in
    order), block tables and context lengths (past the shared prefix, if any), at least two rows and
    two blocks (a size of one would be compiled apart, as a specialisation); `prefixes` are the
    (first row, end row, shared blocks) of groups of rows that share prefix blocks: where there are
    any, every row is in one, in order, so that one merge takes in every group's prefix."""

    tokens: torch.Tensor | None
    count: int  # real rows; the tensors may hold one more (a repeated row)
    tables: torch.Tensor | None  # None where the rows go in parts (`order`)
    lens: torch.Tensor
    prefixes: list[tuple[int, int, torch.Tensor]]
    # Where rows are tokens of short chunks, their attention past the prefixes goes by chunk
    # (`cpu_chunks`), and the other rows through the kernel in `kernels` (split by width where the
    # tails differ); `order` takes the kernels' rows and then the chunks' back to row order.
    # Where the native kernels are chosen, the chunks' rows go instead in one `span_attention` call:
    # `span_rows` (positions in the call, chunk by chunk) through `spans`.
    chunks: list[ChunkBatch] = field(default_factory=list)
    span_rows: torch.Tensor | None = None
    spans: cpu_native.Spans | None = None
    kernels: list[KernelPart] = field(default_factory=list)
    order: torch.Tensor | None = None
    prefix_plan: object = field(default=None, init=False, repr=False)  # (plan,) once made by _prefix_plan

    def __post_init__(self):
        if self.prefixes:
            bounds = [0] + [end for _, end, _ in self.prefixes]
            assert [start for start, _, _ in self.prefixes] == bounds[:-1] and bounds[-1] == self.lens.shape[0]

    def _prefix_plan(self, query, k_cache):
        """How the prefixes are computed (`cpu_prefix.plan_for`), planned at the first layer."""
        if self.prefix_plan is None:
            kernel = prefix_kernel(k_cache.dtype, query.shape[1], *k_cache.shape[2:], k_cache.shape[1])
            self.prefix_plan = (plan_for(kernel, self.prefixes, query.shape[1], k_cache.shape[2], k_cache.shape[1]),)
        return self.prefix_plan[0]

    def _tails(self, q, k_cache, v_cache, scale):
        """Every row's attention over its context past the shared prefix, and its log-sum-exp."""
        if self.order is None:
            return decode_kernel(q, k_cache, v_cache, self.tables, self.lens, scale)
        parts = []
        for part in self.kernels:
            out, lse = decode_kernel(q.index_select(0, part.rows), k_cache, v_cache, part.tables, part.lens, scale)
            parts.append((out[: part.count], lse[: part.count]))
        parts += [chunk_attention(q, k_cache, v_cache, batch, scale) for batch in self.chunks]
        if self.spans is not None:
            parts.append(self.spans.run(q.index_select(0, self.span_rows), k_cache, v_cache, scale))
        out, lse = (torch.cat(p) for p in zip(*parts))
        return out.index_select(0, self.order), lse.index_select(0, self.order)

    def run(self, query, k_cache, v_cache, scale, out) -> None:
        q = query if self.tokens is None else query.index_select(0, self.tokens)
        result, lse = self._tails(q, k_cache, v_cache, scale)
        if self.prefixes:
            prefix_out, prefix_lse = grouped_prefix_attention(
                q, k_cache, v_cache, self.prefixes, scale, self._prefix_plan(q, k_cache)
            )
            merged = cpu_native.merge_partial(prefix_out, prefix_lse, result, lse)
            result = merged[0] if merged is not None else _merge(prefix_out, prefix_lse, result, lse)
        result = result[: self.count].to(out.dtype)
        if self.tokens is None:
            out.copy_(result)
        else:
            out.index_copy_(0, self.tokens[: self.count], result)


@dataclass
class DecodePlan:
    lengths: list[int]
    starts: list[int]
    calls: list[DecodeCall]
    long_chunks: list[int]  # sequences left to `prefill_attention`


def width_groups(widths: list[int], max_groups: int = MAX_GROUPS) -> list[list[int]]:
    """Indices of `widths` (blocks per context) in groups of one kernel call each. A call pads every
    context to its group's widest, so a group is split in two where that saves at least MIN_SAVING of
    its padded work, largest saving first, up to `max_groups` groups."""
    if not widths:
        return []
    groups = [sorted(range(len(widths)), key=widths.__getitem__)]
    while len(groups) < max_groups:
        best = None  # (saving, group, split)
        for g, members in enumerate(groups):
            padded = len(members) * widths[members[-1]]
            for k in range(1, len(members)):
                saving = padded - k * widths[members[k - 1]] - (len(members) - k) * widths[members[-1]]
                if saving >= MIN_SAVING * padded and (best is None or saving > best[0]):
                    best = (saving, g, k)
        if best is None:
            break
        _, g, k = best
        members = groups.pop(g)
        groups[g:g] = [members[:k], members[k:]]
    return groups


def _worth_sharing(members: list[int], shared: int, block_size: int) -> bool:
    """Whether a group's shared prefix goes apart (read once for the group, merged into each row's tail):
    only where that spares at least MIN_SHARED_READS reads of a position. A group costs calls of its own at
    every layer (flash attention group by group, the merge), which a pair of lines that repeat a small
    picture (a prefix of a block or two) never wins back: their rows go whole through the kernel."""
    return shared > 0 and (len(members) - 1) * shared * block_size >= MIN_SHARED_READS


def plan_decodes(
    block_tables, seq_lens, query_start_loc, block_size: int, heads: tuple[int, int], native_chunks: bool = False
) -> DecodePlan:
    """The step's kernel calls: every single-token query, and every query of a chunk of at most
    SHORT_CHUNK tokens (each token a row of its own, its context ending at its position), the
    chunks' rows batched by chunk (`cpu_chunks`, or the native span kernel where `native_chunks`);
    `heads` are (query heads, KV heads)."""
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    plain = _plain_decodes(block_tables, seq_lens, starts, lengths, block_size)
    if plain is not None:
        return plain
    seqs = [i for i in range(len(lengths)) if 1 <= starts[i + 1] - starts[i] <= SHORT_CHUNK]
    device = block_tables.device
    seq_tables = block_tables.index_select(0, torch.tensor(seqs, device=device)).tolist() if seqs else []
    tokens, tables, row_lens, row_seqs = [], [], [], []  # per row
    for i, table in zip(seqs, seq_tables):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            tokens.append(starts[i] + j)
            tables.append(table)
            row_lens.append(lengths[i] - q_len + 1 + j)
            row_seqs.append(i)
    groups = reference.shared_prefixes(tables, row_lens, block_size)
    calls = []
    shared_rows = [(members, shared) for members, shared in groups if _worth_sharing(members, shared, block_size)]
    if shared_rows:  # every group's tails in one call, each group's prefix merged in after
        rows, tails, prefixes = [], [], []
        for members, shared in shared_rows:
            prefixes.append(
                (len(rows), len(rows) + len(members), torch.tensor(tables[members[0]][:shared], device=device))
            )
            rows.extend(members)
            cut: dict[int, list[int]] = {}  # a chunk's rows hold one table: cut it once, not once per row
            for m in members:
                tail = cut.get(id(tables[m]))
                if tail is None:
                    tail = cut[id(tables[m])] = tables[m][shared:]
                tails.append((tail, row_lens[m] - shared * block_size))
        calls.append(
            _call(
                rows,
                tails,
                tokens,
                prefixes,
                block_size,
                whole_step=False,
                device=device,
                row_seqs=row_seqs,
                heads=heads,
                native_chunks=native_chunks,
            )
        )
    kept = {id(members) for members, _ in shared_rows}
    alone = sorted(m for members, _ in groups if id(members) not in kept for m in members)  # in row order
    # the chunks' rows in one call of their own, batched by chunk there
    in_chunk = [starts[row_seqs[m] + 1] - starts[row_seqs[m]] > 1 for m in alone]
    chunk_rows = [m for m, chunked in zip(alone, in_chunk) if chunked]
    alone = [m for m, chunked in zip(alone, in_chunk) if not chunked]
    row_groups = [[alone[j] for j in sub] for sub in width_groups([-(-row_lens[m] // block_size) for m in alone])]
    for rows in row_groups + ([chunk_rows] if chunk_rows else []):
        if len(rows) == 1:
            rows = rows * 2
        whole_step = [tokens[r] for r in rows] == list(range(starts[-1]))
        calls.append(
            _call(
                rows,
                [(tables[r], row_lens[r]) for r in rows],
                tokens,
                [],
                block_size,
                whole_step,
                device,
                row_seqs=row_seqs,
                heads=heads,
                native_chunks=native_chunks,
            )
        )
    long_chunks = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] > SHORT_CHUNK]
    return DecodePlan(lengths, starts, calls, long_chunks)


def _plain_decodes(block_tables, seq_lens, starts, lengths, block_size: int) -> DecodePlan | None:
    """The plan that the general one comes to for the common decode step, without its per-row Python:
    every query one token, no two tables starting with one block (nothing shared), the contexts in one
    width group: one kernel call over the step's tables. None for any other step."""
    rows = len(lengths)
    if rows < 2 or starts != list(range(rows + 1)) or len(set(block_tables[:, 0].tolist())) < rows:
        return None
    widths = np.sort(-(-seq_lens.numpy().astype(np.int64) // block_size))
    # width_groups' first split, vectorised: where no split saves MIN_SAVING, it keeps one group
    padded, k = rows * widths[-1], np.arange(1, rows)
    if (padded - k * widths[:-1] - (rows - k) * widths[-1] >= MIN_SAVING * padded).any():
        return None
    width = max(2, int(widths[-1]))
    tables = block_tables[:, :width].to(torch.int32)
    if tables.shape[1] < width:
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
    call = DecodeCall(tokens=None, count=rows, tables=tables, lens=seq_lens.to(torch.int32), prefixes=[])
    return DecodePlan(lengths, starts, [call], [])


def _call(rows, tails, tokens, prefixes, block_size, whole_step, device, row_seqs, heads, native_chunks) -> DecodeCall:
    """A DecodeCall over `rows` (indices into `tokens`), each with its (block table, context length)."""
    call = DecodeCall(
        tokens=None if whole_step else torch.tensor([tokens[r] for r in rows], device=device),
        count=len(set(rows)),
        tables=None,
        lens=torch.tensor([n for _, n in tails], dtype=torch.int32, device=device),
        prefixes=prefixes,
    )
    _plan_tails(call, rows, tails, row_seqs, heads, block_size, device, native_chunks)
    if call.order is None:  # one kernel call over every row: their tables (else each part has its own)
        call.tables = _tables([t for t, _ in tails], max(2, -(-max(n for _, n in tails) // block_size)), device)
    return call


def _plan_tails(call: DecodeCall, rows, tails, row_seqs, heads, block_size, device, native_chunks) -> None:
    """Take the call's rows that are tokens of one chunk out of the kernel, into chunk batches (or
    spans of the native kernel), and split the rest into kernel calls of similar widths
    (`width_groups`) where that saves work."""
    by_seq: dict[int, list[int]] = {}
    for position, r in enumerate(rows[: call.count]):  # not a repeated row
        by_seq.setdefault(row_seqs[r], []).append(position)
    chunks = [
        Chunk(positions, [tails[p][1] for p in positions], tails[positions[0]][0])
        for positions in by_seq.values()
        if len(positions) >= MIN_CHUNK_ROWS
    ]
    batches, left_out = [], []
    if chunks and native_chunks:
        call.span_rows = torch.tensor([p for chunk in chunks for p in chunk.rows], device=device)
        call.spans = cpu_native.plan_spans(
            [chunk.blocks for chunk in chunks],
            [len(chunk.rows) for chunk in chunks],
            [n for chunk in chunks for n in chunk.lens],
            device,
        )
    elif chunks:
        batches, left_out = plan_chunks(chunks, *heads, block_size, device)
    batched = {p for chunk in chunks if all(chunk is not c for c in left_out) for p in chunk.rows}
    kernel = [p for p in range(call.count) if p not in batched]
    groups = [[kernel[j] for j in sub] for sub in width_groups([-(-tails[p][1] // block_size) for p in kernel])]
    if not batches and call.spans is None and len(groups) <= 1:
        return  # the whole call through one kernel call
    computed = [p for group in groups for p in group]
    computed += [p for batch in batches for p in batch.rows.flatten()[batch.picks].tolist()]
    computed += [p for chunk in chunks for p in chunk.rows] if call.spans is not None else []
    order = torch.empty(len(computed), dtype=torch.long)
    order[torch.tensor(computed)] = torch.arange(len(computed))
    call.chunks, call.order = batches, order.to(device)
    for group in groups:
        padded = group * 2 if len(group) == 1 else group  # a size of one would be compiled apart
        width = max(2, -(-max(tails[p][1] for p in group) // block_size))
        call.kernels.append(
            KernelPart(
                torch.tensor(padded, device=device),
                len(group),
                _tables([tails[p][0] for p in padded], width, device),
                torch.tensor([tails[p][1] for p in padded], dtype=torch.int32, device=device),
            )
        )


def _tables(tables: list[list[int]], width: int, device) -> torch.Tensor:
    padded: dict[int, list[int]] = {}  # rows of one chunk hold one table: pad it once
    for t in tables:
        if id(t) not in padded:
            padded[id(t)] = _padded(t[:width], width)
    return torch.tensor([padded[id(t)] for t in tables], dtype=torch.int32, device=device)


def _padded(blocks: list[int], width: int) -> list[int]:
    return blocks + [0] * (width - len(blocks))


_plans = threading.local()


def _step_plan(
    block_tables, seq_lens, query_start_loc, block_size: int, heads: tuple[int, int], native_chunks: bool
) -> DecodePlan:
    """Every layer of a step gets the same metadata tensors: plan once, for as long as the same
    objects hold the same contents (static buffers are updated in place: their version changes)."""
    inputs = (block_tables, seq_lens, query_start_loc)
    key = tuple((id(t), t._version) for t in inputs) + (block_size, heads, native_chunks)
    cached = getattr(_plans, "entry", None)
    if cached is None or cached[0] != key:
        # the tensors stay referenced beside their key, so that no other tensor can take their ids
        plan = plan_decodes(block_tables, seq_lens, query_start_loc, block_size, heads, native_chunks)
        cached = _plans.entry = (key, inputs, plan)
    return cached[2]


def paged_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """`pagedbatch_kernels.reference.paged_attention`'s contract. Sliding-window and soft-capped
    layers go through the native kernels' banded calls (`cpu_window`), or where those are not built,
    the reference (the compiled kernels here have no window bound or cap); both read only the blocks
    in reach of a window. Sink layers (gpt-oss) take the reference: no kernel here has sinks."""
    if (window or softcap) and sinks is None and cpu_native.supports(query, k_cache):
        return banded_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=window, softcap=softcap
        )
    if window or softcap or sinks is not None:
        return reference.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    out = torch.empty_like(query)
    heads = (query.shape[1], k_cache.shape[2])
    # the chunks' rows go to the native span kernel where it is the prefixes' choice
    native_chunks = (
        cpu_native.supports(query, k_cache)
        and prefix_kernel(k_cache.dtype, *heads, k_cache.shape[3], k_cache.shape[1]) == "native"
    )
    plan = _step_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], heads, native_chunks)
    for call in plan.calls:
        call.run(query, k_cache, v_cache, scale, out)
    prefill_attention(query, k_cache, v_cache, block_tables, plan.lengths, plan.starts, scale, out, plan.long_chunks)
    return out
