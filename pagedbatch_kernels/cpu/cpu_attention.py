"""The CPU engine's paged attention: decodes through kernels that read K/V where they lie in the pool,
prompts through `cpu_prefill`.

The reference gathers each decode's context out of the pool (`index_select`) and then lays it out
again for a batched matmul, at every layer: two copies of every context per step. The decode kernel
loads each key and value from its block directly: our C++ one (`cpu_native`) where it can be built,
else `decode_attention` compiled by inductor (`pagedbatch_kernels.compiled`) into a few fused loops. Decodes
whose block tables start with the same blocks (a shared system prompt, sibling samples) read those
blocks once for the whole group, every member's queries at once (`cpu_prefix`), and only their own
tails through the kernel; the two partial results merge by their log-sum-exp. Which decode goes in
which call is planned once per step (a `cpu_decode_calls.DecodePlan`) and reused by every layer.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_decode_calls import (
    MAX_GROUPS,
    MIN_SAVING,
    DecodeCall,
    DecodePlan,
    build_call,
    width_groups,
)
from pagedbatch_kernels.cpu.cpu_prefill import matmul_dtype, prefill_attention
from pagedbatch_kernels.cpu.cpu_prefix import prefix_kernel
from pagedbatch_kernels.cpu.cpu_window import banded_attention

# Chunks of up to this many new tokens go through the decode kernels, a row per token (a prompt's
# tail after a cached prefix, say); longer ones through flash SDPA, one sequence at a time.
SHORT_CHUNK = 64
# A group of rows sharing prefix blocks takes them apart (read once, one matmul over the group's queries, merged
# into each row's tail) only where its prefix has at least the first number of positions and that spares at least
# the second number of position reads ((rows - 1) x shared positions). A short prefix (a chat template's head, a
# repeated small picture) costs the kernel little to read, from cache, row by row; the group's own calls and the
# merge at every layer cost more. By whether the prefix's matmuls run in bfloat16 (`cpu_prefill.matmul_dtype`).
# Measured on an AMD EPYC, `python -m bench.decode_plan`'s second table and `bench.vs_vllm`'s shared_prefix
# workload (8 prompts of 512 tokens, ~32 rows each: apart is 6-9 % faster there, in both dtypes).
SHARING_BOUNDS = {True: (128, 128), False: (256, 128)}
SHARE_ANY = (1, 0)  # every shared block goes apart
MAX_FAST_GROUPS = 8


def sharing_bounds(k_cache: torch.Tensor) -> tuple[int, int]:
    """(least shared positions, least spared position reads) for a group's prefix to go apart, for this pool."""
    return SHARING_BOUNDS[matmul_dtype(k_cache.dtype) == torch.bfloat16]


def _worth_sharing(members, shared: int, block_size: int, sharing: tuple[int, int]) -> bool:
    """Whether a group's shared prefix goes apart (`sharing`: least shared positions and spared position reads)."""
    positions, spared = sharing
    return shared > 0 and shared * block_size >= positions and (len(members) - 1) * shared * block_size >= spared


def plan_decodes(
    block_tables,
    seq_lens,
    query_start_loc,
    block_size: int,
    heads: tuple[int, int],
    native_chunks: bool = False,
    sharing: tuple[int, int] = SHARE_ANY,
    shortcut: bool = True,
) -> DecodePlan:
    """The step's kernel calls: every single-token query, and every query of a chunk of at most
    SHORT_CHUNK tokens (each token a row of its own, its context ending at its position), the
    chunks' rows batched by chunk (`cpu_chunks`, or the native span kernel where `native_chunks`);
    `heads` are (query heads, KV heads); `sharing` says which shared prefixes go apart (`sharing_bounds`).
    A plain decode step takes a shortcut to the same plan (`_decodes_only`); `shortcut=False` plans it the
    general way (for the comparisons)."""
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    plain = _decodes_only(block_tables, seq_lens, starts, lengths, block_size, sharing) if shortcut else None
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
    shared_rows = [
        (members, shared) for members, shared in groups if _worth_sharing(members, shared, block_size, sharing)
    ]
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
            build_call(
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
            build_call(
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


def _decodes_only(block_tables, seq_lens, starts, lengths, block_size: int, sharing=SHARE_ANY) -> DecodePlan | None:
    """The plan that the general one comes to for a decode step (every query one token), without its
    per-row Python: the rows of groups worth sharing their first blocks (`_sharing_groups`) in one call,
    each group's prefix apart, and the other rows in calls of their own by width (`_width_groups`; the whole
    step in one where nothing is shared or split). None where the shared rows' call would split by width,
    where many groups share, and for any other step."""
    rows = len(lengths)
    if rows < 2 or starts != list(range(rows + 1)) or block_tables.device.type != "cpu":
        return None
    tables, lens = block_tables.numpy(), seq_lens.numpy().astype(np.int64)
    groups = _sharing_groups(tables, lens, block_size, sharing)
    if groups is None:
        return None
    calls, alone = [], np.arange(rows)
    if groups:
        members = np.concatenate([m for m, _ in groups])
        tails = lens[members] - np.concatenate([np.full(len(m), shared) for m, shared in groups]) * block_size
        width = _one_width_group(-(-tails // block_size))
        if width is None:
            return None
        tail_tables, prefixes, first = np.zeros((len(members), width), np.int32), [], 0
        for m, shared in groups:
            part = tables[m, shared : shared + width]
            tail_tables[first : first + len(m), : part.shape[1]] = part
            prefixes.append((first, first + len(m), torch.from_numpy(tables[m[0], :shared].astype(np.int64))))
            first += len(m)
        calls.append(_decode_call(members, len(members), tail_tables, tails, prefixes))
        outside = np.ones(rows, dtype=bool)
        outside[members] = False
        alone = np.flatnonzero(outside)
    widths = -(-lens[alone] // block_size)
    groups = _width_groups(widths) if len(alone) else []
    if len(groups) > 1 and any(_one_width_group(widths[group]) is None for group in groups):
        return None  # the general plan splits a group again, into parts of one call
    for group in groups:
        width = max(2, int(widths[group].max()))
        picked = alone[group] if len(group) > 1 else np.repeat(alone[group], 2)  # one would be compiled apart
        part = tables[:, :width] if len(group) == rows else tables[picked, :width]
        padded = np.zeros((len(picked), width), np.int32)
        padded[:, : part.shape[1]] = part
        calls.append(_decode_call(None if len(group) == rows else picked, len(group), padded, lens[picked], []))
    return DecodePlan(lengths, starts, calls, [])


def _width_groups(widths: np.ndarray) -> list[np.ndarray]:
    """`cpu_decode_calls.width_groups` over arrays: the indices of `widths` in groups of one kernel call each,
    split where that saves MIN_SAVING of a group's padded work, largest saving first (one group: in order)."""
    groups = [np.argsort(widths, kind="stable")]
    while len(groups) < MAX_GROUPS:
        best = None  # (saving, group, split)
        for g, members in enumerate(groups):
            sorted_widths, count = widths[members], len(members)
            padded, k = count * sorted_widths[-1], np.arange(1, count)
            saving = padded - k * sorted_widths[:-1] - (count - k) * sorted_widths[-1]
            saving = np.where(saving >= MIN_SAVING * padded, saving, -1)
            split = int(saving.argmax()) if count > 1 else 0
            if count > 1 and saving[split] >= 0 and (best is None or saving[split] > best[0]):
                best = (saving[split], g, split + 1)
        if best is None:
            break
        _, g, split = best
        members = groups.pop(g)
        groups[g:g] = [members[:split], members[split:]]
    return groups if len(groups) > 1 else [np.arange(len(widths))]


def _decode_call(tokens, count, tables, lens, prefixes) -> DecodeCall:
    return DecodeCall(
        tokens=None if tokens is None else torch.from_numpy(tokens),
        count=count,
        tables=torch.from_numpy(tables),
        lens=torch.from_numpy(lens.astype(np.int32)),
        prefixes=prefixes,
    )


def _sharing_groups(tables: np.ndarray, lens: np.ndarray, block_size: int, sharing) -> list | None:
    """The (rows, shared blocks) that `reference.shared_prefixes` finds and `_worth_sharing` keeps, in the
    general plan's order; None where more than MAX_FAST_GROUPS groups could be worth sharing (a loop per group
    there costs what the general plan's loop per row does). Groups too small or too short to be worth it even
    if they shared every block short of their last tokens (pairs repeating a picture) cost no loop."""
    if len(set(tables[:, 0].tolist())) == len(tables):
        return []  # no two tables start with one block
    _, first_rows, group_of, counts = np.unique(
        tables[:, 0], return_index=True, return_inverse=True, return_counts=True
    )
    by_group = np.argsort(group_of, kind="stable")  # each group's rows together, in row order
    firsts = np.cumsum(counts) - counts
    most_shared = (np.minimum.reduceat(lens[by_group], firsts) - 1) // block_size * block_size  # positions
    positions, spared = sharing
    candidates = np.flatnonzero((counts > 1) & (most_shared >= positions) & ((counts - 1) * most_shared >= spared))
    if len(candidates) > MAX_FAST_GROUPS:
        return None
    groups = []
    for group in candidates[np.argsort(first_rows[candidates])]:
        members = by_group[firsts[group] : firsts[group] + counts[group]]
        limit = int(most_shared[group]) // block_size
        same = (tables[members, :limit] == tables[members[0], :limit]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))
        if _worth_sharing(members, shared, block_size, sharing):
            groups.append((members, shared))
    return groups


def _one_width_group(widths: np.ndarray) -> int | None:
    """The call's table width where `width_groups` keeps these rows in one group (its first split, over
    arrays: no split saves MIN_SAVING of the padded work), else None."""
    widths = np.sort(widths)
    rows = len(widths)
    padded, k = rows * widths[-1], np.arange(1, rows)
    if (padded - k * widths[:-1] - (rows - k) * widths[-1] >= MIN_SAVING * padded).any():
        return None
    return max(2, int(widths[-1]))


_plans = threading.local()


def _step_plan(
    block_tables, seq_lens, query_start_loc, block_size: int, heads: tuple[int, int], native_chunks: bool, sharing
) -> DecodePlan:
    """Every layer of a step gets the same metadata tensors: plan once, for as long as the same
    objects hold the same contents (static buffers are updated in place: their version changes)."""
    inputs = (block_tables, seq_lens, query_start_loc)
    key = tuple((id(t), t._version) for t in inputs) + (block_size, heads, native_chunks, sharing)
    cached = getattr(_plans, "entry", None)
    if cached is None or cached[0] != key:
        # the tensors stay referenced beside their key, so that no other tensor can take their ids
        plan = plan_decodes(block_tables, seq_lens, query_start_loc, block_size, heads, native_chunks, sharing)
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
    sharing = sharing_bounds(k_cache)
    plan = _step_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], heads, native_chunks, sharing)
    for call in plan.calls:
        call.run(query, k_cache, v_cache, scale, out)
    prefill_attention(query, k_cache, v_cache, block_tables, plan.lengths, plan.starts, scale, out, plan.long_chunks)
    return out
