"""A scheduled step's model inputs as plain lists (what rank 0 broadcasts to the other ranks, which have
no sequences), and the tensors each rank builds from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.models.llama import AttentionInputs
from engine.runner.block_tables import BlockTableRows
from engine.runner.device import to_device


@dataclass
class StepPlan:
    """Lists, or (a decode step planned with BlockTableRows) CPU tensors of the dtypes `step_tensors` makes."""

    input_ids: list[int] | torch.Tensor
    positions: list[int] | torch.Tensor
    slots: list[int] | torch.Tensor
    block_tables: list[list[int]] | torch.Tensor  # a tensor from BlockTableRows
    seq_lens: list[int] | torch.Tensor
    starts: list[int] | torch.Tensor  # query_start_loc
    sample_rows: list[int] | torch.Tensor  # the rows whose logits are sampled: the sequences that end their input here
    max_query_len: int


def plan_step(batch, block_size: int, tables: BlockTableRows | None = None) -> StepPlan:
    """`tables`: the runner's persistent block-table rows (then `block_tables` is a tensor, not lists)."""
    if batch.num_tokens == len(batch.seqs):
        return (
            _plan_decode(batch.seqs, block_size, tables)
            if tables is None
            else _decode_arrays(batch.seqs, block_size, tables)
        )
    input_ids, positions, slots, seq_lens, starts, sample_rows = [], [], [], [], [0], []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        end = start + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        if end == len(seq):
            sample_rows.append(starts[-1] - 1)
    return StepPlan(
        input_ids, positions, slots, _tables(batch.seqs, tables), seq_lens, starts, sample_rows,
        max(batch.num_new_tokens),
    )  # fmt: skip


def _plan_decode(seqs, block_size: int, tables: BlockTableRows | None) -> StepPlan:
    """A step in which every sequence computes one token (each of them decoding, or a one-token chunk)."""
    positions = [s.num_computed_tokens for s in seqs]
    return StepPlan(
        input_ids=[s.token_ids[p] for s, p in zip(seqs, positions)],
        positions=positions,
        slots=[s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)],
        block_tables=_tables(seqs, tables),
        seq_lens=[p + 1 for p in positions],
        starts=list(range(len(seqs) + 1)),
        sample_rows=[i for i, (s, p) in enumerate(zip(seqs, positions)) if p + 1 == len(s.token_ids)],
        max_query_len=1,
    )


def _decode_arrays(seqs, block_size: int, tables: BlockTableRows) -> StepPlan:
    """`_plan_decode`'s plan as tensors: positions and lengths gathered once, each slot looked up in the
    kept table rows by numpy rather than per sequence in Python."""
    n = len(seqs)
    positions = np.fromiter([s.num_computed_tokens for s in seqs], np.int64, n)
    lengths = np.fromiter([len(s.token_ids) for s in seqs], np.int64, n)
    input_ids = np.fromiter([s.token_ids[p] for s, p in zip(seqs, positions.tolist())], np.int64, n)
    block_tables = tables.tensor(seqs)
    blocks = block_tables.numpy()[np.arange(n), positions // block_size].astype(np.int64)
    return StepPlan(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        slots=torch.from_numpy(blocks * block_size + positions % block_size),
        block_tables=block_tables,
        seq_lens=torch.from_numpy((positions + 1).astype(np.int32)),
        starts=torch.arange(n + 1, dtype=torch.int32),
        sample_rows=torch.from_numpy(np.flatnonzero(positions + 1 == lengths)),
        max_query_len=1,
    )


def _tables(seqs, tables: BlockTableRows | None):
    if tables is not None:
        return tables.tensor(seqs)
    max_blocks = max(len(s.block_table) for s in seqs)
    return [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]


def step_tensors(plan: StepPlan, device: torch.device, kv_caches, hints: bool):
    """(input ids, AttentionInputs, sample rows) on `device`; `hints`: the kernels take max lengths."""
    extra = dict(max_query_len=plan.max_query_len, max_seq_len=int(max(plan.seq_lens))) if hints else {}
    inputs = AttentionInputs(
        positions=to_device(plan.positions, torch.long, device),
        slot_mapping=to_device(plan.slots, torch.long, device),
        block_tables=to_device(plan.block_tables, torch.int32, device),
        seq_lens=to_device(plan.seq_lens, torch.int32, device),
        query_start_loc=to_device(plan.starts, torch.int32, device),
        kv_caches=kv_caches,
        **extra,
    )
    return to_device(plan.input_ids, torch.long, device), inputs, to_device(plan.sample_rows, torch.long, device)
