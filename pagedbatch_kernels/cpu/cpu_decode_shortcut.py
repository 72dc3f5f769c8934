"""The calls of a step's single-token queries (decodes) and short prompt chunks, planned over arrays: what
`cpu_attention`'s general planning comes to for them, without its Python per row (a decode step of 256 rows:
0.6-0.8 ms there, 0.05-0.15 here; a step of 200 prompts of 30 tokens: ~12 ms there). The decodes of groups worth
sharing their first blocks go in one call, each group's prefix apart; the others in calls of their own by width;
the chunks in one call of the native span kernel. Where the general planning would do more (split the shared
rows' call by width, or a width group again into parts; a group of chunk rows worth sharing; many groups that
could share), the shortcut stands aside (None).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_decode_calls import MAX_GROUPS, MIN_SAVING, DecodeCall

MAX_FAST_GROUPS = 8  # more groups that could share: a loop per group costs what the general loop per row does
MIN_SHORTCUT_ROWS = 16  # a step's decodes beside its prompt chunks take the shortcut from this many


def worth_sharing(members, shared: int, block_size: int, sharing: tuple[int, int]) -> bool:
    """Whether a group's shared prefix goes apart (`sharing`: least shared positions and spared position reads)."""
    positions, spared = sharing
    return shared > 0 and shared * block_size >= positions and (len(members) - 1) * shared * block_size >= spared


def single_token_calls(
    tables: np.ndarray, lens: np.ndarray, positions: np.ndarray | None, block_size: int, sharing
) -> list[DecodeCall] | None:
    """The calls of single-token rows with these block tables and context lengths; `positions` are the rows'
    tokens in the step (None: row r is token r, and the rows are the whole step)."""
    rows = len(lens)
    groups = _sharing_groups(tables, lens, block_size, sharing)
    if groups is None:
        return None

    def tokens(picked):
        return picked if positions is None else positions[picked]

    calls, alone = [], np.arange(rows)
    if groups:
        members = np.concatenate([m for m, _ in groups])
        tails = lens[members] - np.concatenate([np.full(len(m), shared) for m, shared in groups]) * block_size
        width = _one_width_group(-(-tails // block_size))
        if width is None:
            return None
        tail_tables = np.concatenate([_columns(tables, m, shared, width) for m, shared in groups])
        prefixes, first = [], 0
        for m, shared in groups:
            prefixes.append((first, first + len(m), torch.from_numpy(tables[m[0], :shared].astype(np.int64))))
            first += len(m)
        calls.append(_call(tokens(members), len(members), tail_tables, tails, prefixes))
        outside = np.ones(rows, dtype=bool)
        outside[members] = False
        alone = np.flatnonzero(outside)
    widths = -(-lens[alone] // block_size)
    groups = width_groups(widths) if len(alone) else []
    if len(groups) > 1 and any(_one_width_group(widths[group]) is None for group in groups):
        return None  # the general plan splits a group again, into parts of one call
    for group in groups:
        width = max(2, int(widths[group].max()))
        picked = alone[group] if len(group) > 1 else np.repeat(alone[group], 2)  # one would be compiled apart
        whole = positions is None and len(group) == rows
        padded = _columns(tables, slice(None) if whole else picked, 0, width)
        calls.append(_call(None if whole else tokens(picked), len(group), padded, lens[picked], []))
    return calls


def _columns(tables: np.ndarray, rows, first: int, width: int) -> np.ndarray:
    """tables[rows, first : first + width] as int32, zero-padded to `width` columns."""
    part = tables[rows, first : first + width]
    padded = np.zeros((part.shape[0], width), np.int32)
    padded[:, : part.shape[1]] = part
    return padded


def chunk_spans_call(
    tables: np.ndarray, lens: np.ndarray, offsets: np.ndarray, seqs: np.ndarray, block_size: int, sharing
) -> DecodeCall | None:
    """The call of the short prompt chunks of `seqs` (a row per token, each chunk a span of the native span
    kernel, its token j seeing its context up to itself), as the general planning makes it where no group of
    their rows is worth sharing its first blocks; None where one could be (the general way then)."""
    q_lens = offsets[seqs + 1] - offsets[seqs]
    contexts = lens[seqs] - q_lens  # positions before each chunk: a chunk's rows share its table's blocks up to there
    _, group_of = np.unique(tables[seqs, 0], return_inverse=True)
    rows = np.bincount(group_of, weights=q_lens).astype(np.int64)
    fewest = np.full(len(rows), np.iinfo(np.int64).max)
    np.minimum.at(fewest, group_of, contexts)
    most_shared = fewest // block_size * block_size  # the first row of each group sees its context and itself
    positions, spared = sharing
    if ((rows > 1) & (most_shared >= positions) & ((rows - 1) * most_shared >= spared)).any():
        return None
    firsts = np.cumsum(q_lens) - q_lens
    within = np.arange(int(q_lens.sum())) - np.repeat(firsts, q_lens)  # each row's place in its chunk
    count = len(within)
    call = DecodeCall(
        tokens=torch.from_numpy(np.repeat(offsets[seqs], q_lens) + within),
        count=count,
        tables=None,
        lens=torch.from_numpy((np.repeat(contexts, q_lens) + 1 + within).astype(np.int32)),
        prefixes=[],
    )
    call.span_rows = call.order = torch.arange(count)
    call.spans = cpu_native.Spans(
        tables=torch.from_numpy(tables[seqs].astype(np.int32)),
        bounds=torch.from_numpy(np.stack([firsts, firsts + q_lens], axis=1).astype(np.int32)),
        lengths=call.lens,
    )
    return call


def _call(tokens, count, tables, lens, prefixes) -> DecodeCall:
    return DecodeCall(
        tokens=None if tokens is None else torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
        count=count,
        tables=torch.from_numpy(tables),
        lens=torch.from_numpy(lens.astype(np.int32)),
        prefixes=prefixes,
    )


def _sharing_groups(tables: np.ndarray, lens: np.ndarray, block_size: int, sharing) -> list | None:
    """The (rows, shared blocks) that `reference.shared_prefixes` finds and `worth_sharing` keeps, in the
    general plan's order; None where more than MAX_FAST_GROUPS groups could be worth sharing. Groups too small
    or too short to be worth it even if they shared every block short of their last tokens (pairs repeating a
    picture) cost no loop."""
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
        if worth_sharing(members, shared, block_size, sharing):
            groups.append((members, shared))
    return groups


def _one_width_group(widths: np.ndarray) -> int | None:
    """The call's table width where `width_groups` keeps these rows in one group (its first split: no split
    saves MIN_SAVING of the padded work), else None."""
    widths = np.sort(widths)
    rows = len(widths)
    padded, k = rows * widths[-1], np.arange(1, rows)
    if (padded - k * widths[:-1] - (rows - k) * widths[-1] >= MIN_SAVING * padded).any():
        return None
    return max(2, int(widths[-1]))


def width_groups(widths: np.ndarray) -> list[np.ndarray]:
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
