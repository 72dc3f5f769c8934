"""How a decode step's attention is cut into kernel calls, and each call run: `DecodeCall` (some rows, their
tables and lengths past any shared prefix, the prefix groups, the parts of rows that go by chunk or by width)
and `DecodePlan` (a step's calls). `cpu_attention` decides which rows go in which call, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_chunks import Chunk, ChunkBatch, chunk_attention, plan_chunks
from pagedbatch_kernels.cpu.cpu_decode import _merge, decode_kernel
from pagedbatch_kernels.cpu.cpu_prefix import grouped_prefix_attention, plan_for, prefix_kernel

MIN_SAVING = 0.25  # a decode group is split where that saves this share of its padded work
MAX_GROUPS = 4
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


def build_call(
    rows, tails, tokens, prefixes, block_size, whole_step, device, row_seqs, heads, native_chunks
) -> DecodeCall:
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
