"""The CPU engine's attention for sliding-window and soft-capped layers (Mistral's `sliding_window`,
Gemma 2's and Gemma 3's local layers, Gemma 2's logit soft-capping), through the native kernels
(`cpu_native`): decodes through `decode_attention`, every prompt chunk (a token or a thousand) through
`span_attention`, both bounded below per row (`lows`: a query at position p sees (p - W, p]) and
soft-capping their scores in the kernel.

Each sequence's block table starts at the first block that any of its new tokens' windows reaches
(`reference.first_window_block`): the blocks wholly behind every window are not read, and their ids
(freed blocks, where the block manager let them go) are never looked at. Shared prefixes are not
looked for (a window reads few blocks; sharing pays on long contexts, which full layers have).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_native


@dataclass
class BandPlan:
    """A step's calls: the decode rows (`rows` of the query) with their tables, lengths and lows, and
    the chunks as spans (`cpu_native.Spans`, rows of the whole query) with every row's low."""

    rows: torch.Tensor | None
    tables: torch.Tensor | None
    lens: torch.Tensor | None
    lows: torch.Tensor | None
    spans: cpu_native.Spans | None
    span_rows: list[tuple[int, int]]
    span_lows: torch.Tensor | None


def plan_bands(block_tables, seq_lens, query_start_loc, block_size: int, window: int | None) -> BandPlan:
    """The step's decode rows and chunk spans, each sequence's table cut to the blocks its window reaches."""
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    device = block_tables.device
    tables_all = block_tables.tolist()
    decode_rows, decode_tables, decode_lens, decode_lows = [], [], [], []
    span_tables, span_rows = [], []
    row_lens, row_lows = [0] * starts[-1], [0] * starts[-1]
    for i, length in enumerate(lengths):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        first = reference.first_window_block(length, q_len, window, block_size)
        offset = first * block_size
        table = tables_all[i][first : -(-length // block_size)]
        if q_len == 1:
            decode_rows.append(starts[i])
            decode_tables.append(table)
            decode_lens.append(length - offset)
            decode_lows.append(max(0, length - window) - offset if window else 0)
            continue
        span_tables.append(table)
        span_rows.append((starts[i], starts[i + 1]))
        for j in range(q_len):
            seen = length - q_len + 1 + j  # positions token j sees, its own included
            row_lens[starts[i] + j] = seen - offset
            row_lows[starts[i] + j] = max(0, seen - window) - offset if window else 0
    plan = BandPlan(None, None, None, None, None, span_rows, None)
    if decode_rows:
        width = max(1, max(len(t) for t in decode_tables))
        plan.rows = torch.tensor(decode_rows, device=device)
        plan.tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.int32, device=device
        )
        plan.lens = torch.tensor(decode_lens, dtype=torch.int32, device=device)
        plan.lows = torch.tensor(decode_lows, dtype=torch.int32, device=device) if window else None
    if span_rows:
        # the spans are the query's own rows; the decodes' rows between them are in no span
        width = max(len(t) for t in span_tables)
        plan.spans = cpu_native.Spans(
            tables=torch.tensor([t + [0] * (width - len(t)) for t in span_tables], dtype=torch.int32, device=device),
            bounds=torch.tensor(span_rows, dtype=torch.int32, device=device),
            lengths=torch.tensor(row_lens, dtype=torch.int32, device=device),
        )
        plan.span_lows = torch.tensor(row_lows, dtype=torch.int32, device=device) if window else None
    return plan


_plans = threading.local()


def _step_plan(block_tables, seq_lens, query_start_loc, block_size: int, window: int | None) -> BandPlan:
    """Planned once per step and window: every layer gets the same metadata tensors (as in
    `cpu_attention._step_plan`; a model with two windows, or windowed and capped full layers, keeps one
    plan for each)."""
    inputs = (block_tables, seq_lens, query_start_loc)
    key = tuple((id(t), t._version) for t in inputs) + (block_size, window)
    entries = getattr(_plans, "entries", None)
    if entries is None or entries[0] != key[:-1]:  # a new step: forget the last one's plans
        entries = _plans.entries = [key[:-1], inputs, {}]
    plan = entries[2].get(window)
    if plan is None:
        plan = entries[2][window] = plan_bands(block_tables, seq_lens, query_start_loc, block_size, window)
    return plan


def banded_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, *, window=None, softcap=None
):
    """`reference.paged_attention`'s contract with a `window` and/or a `softcap`, for tensors that
    `cpu_native.supports` takes."""
    plan = _step_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], window)
    out = torch.empty_like(query)
    if plan.rows is not None:
        result, _ = cpu_native.decode_attention(
            query.index_select(0, plan.rows),
            k_cache,
            v_cache,
            plan.tables,
            plan.lens,
            scale,
            lows=plan.lows,
            softcap=softcap,
        )
        out.index_copy_(0, plan.rows, result.to(out.dtype))
    if plan.spans is not None:
        spans = plan.spans
        result, _ = cpu_native.span_attention(
            query,
            k_cache,
            v_cache,
            spans.tables,
            spans.bounds,
            spans.lengths,
            scale,
            lows=plan.span_lows,
            softcap=softcap,
        )
        for begin, end in plan.span_rows:
            out[begin:end] = result[begin:end].to(out.dtype)
    return out
