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
from pagedbatch_kernels.cpu.cpu_decode_calls import DecodeCall, DecodePlan, build_call, width_groups
from pagedbatch_kernels.cpu.cpu_decode_shortcut import (
    MIN_SHORTCUT_ROWS,
    chunk_spans_call,
    single_token_calls,
    worth_sharing,
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


def sharing_bounds(k_cache: torch.Tensor) -> tuple[int, int]:
    """(least shared positions, least spared position reads) for a group's prefix to go apart, for this pool."""
    return SHARING_BOUNDS[matmul_dtype(k_cache.dtype) == torch.bfloat16]


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
    A step's decodes and short chunks take a shortcut to the same calls over arrays (`_shortcut_plan`; a prefix
    shared by a decode and a chunk of one step is then not taken apart); `shortcut=False` plans every step the
    general way (for the comparisons)."""
    if shortcut and block_tables.device.type == "cpu" and query_start_loc.device.type == "cpu":
        plan = _shortcut_plan(block_tables, seq_lens, query_start_loc, block_size, heads, native_chunks, sharing)
        if plan is not None:
            return plan
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    seqs = [i for i in range(len(lengths)) if 1 <= starts[i + 1] - starts[i] <= SHORT_CHUNK]
    calls = _general_calls(seqs, block_tables, starts, lengths, block_size, heads, native_chunks, sharing)
    long_chunks = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] > SHORT_CHUNK]
    return DecodePlan(lengths, starts, calls, long_chunks)


def _shortcut_plan(block_tables, seq_lens, query_start_loc, block_size, heads, native_chunks, sharing):
    """A step's plan with its decodes' calls, and where the native span kernel takes them its short chunks',
    through `cpu_decode_shortcut`; the chunks the general way beside many decodes; None where the shortcut
    stands aside (or there are few decodes and the chunks cannot go through it)."""
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    offsets = query_start_loc.numpy().astype(np.int64)
    q_lens = np.diff(offsets)
    singles = np.flatnonzero(q_lens == 1)
    tables, lens = block_tables.numpy(), seq_lens.numpy().astype(np.int64)
    if len(singles) == len(lengths) >= 2:  # a decode step: the general plan's calls, over arrays
        calls = single_token_calls(tables, lens, None, block_size, sharing)
        return None if calls is None else DecodePlan(lengths, starts, calls, [])
    calls = []
    if len(singles):
        calls = single_token_calls(tables[singles], lens[singles], offsets[singles], block_size, sharing)
        if calls is None:
            return None
    chunks = np.flatnonzero((q_lens > 1) & (q_lens <= SHORT_CHUNK))
    if len(chunks):
        spans = chunk_spans_call(tables, lens, offsets, chunks, block_size, sharing) if native_chunks else None
        if spans is not None:
            calls.append(spans)
        elif len(singles) >= MIN_SHORTCUT_ROWS:
            calls += _general_calls(
                chunks.tolist(), block_tables, starts, lengths, block_size, heads, native_chunks, sharing
            )
        else:
            return None
    return DecodePlan(lengths, starts, calls, np.flatnonzero(q_lens > SHORT_CHUNK).tolist())


def _general_calls(seqs, block_tables, starts, lengths, block_size, heads, native_chunks, sharing) -> list[DecodeCall]:
    """The calls of the queries of `seqs` (chunks of at most SHORT_CHUNK tokens), row by row in Python."""
    if not seqs:
        return []
    device = block_tables.device
    seq_tables = block_tables.index_select(0, torch.tensor(seqs, device=device)).tolist()
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
        (members, shared) for members, shared in groups if worth_sharing(members, shared, block_size, sharing)
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
    return calls


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
