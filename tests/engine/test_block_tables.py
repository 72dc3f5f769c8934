"""The block tables kept between steps (engine.runner.block_tables) equal the tables rebuilt from lists."""

from __future__ import annotations

import random

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.params.sampling_params import SamplingParams
from engine.runner.block_tables import BlockTableRows
from engine.runner.step_plan import plan_step, step_tensors


def _padded(seqs) -> torch.Tensor:
    width = max(len(s.block_table) for s in seqs)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)


def test_rows_follow_growth_replacement_and_reordering():
    rng = random.Random(0)
    seqs = [Sequence(i, str(i), 0, [1, 2, 3], SamplingParams()) for i in range(12)]
    for s in seqs:
        s.block_table = [rng.randrange(100) for _ in range(rng.randint(1, 4))]
    rows = BlockTableRows(max_rows=8, width=4)  # fewer rows and columns than the steps need: they grow
    for _ in range(200):
        for s in rng.sample(seqs, 4):
            if rng.random() < 0.2:
                s.block_table = [rng.randrange(100) for _ in range(rng.randint(0, 3))]  # released, regrown
            else:
                s.block_table.append(rng.randrange(100))  # grown in place
            if not s.block_table:
                s.block_table.append(rng.randrange(100))
        batch = rng.sample(seqs, rng.randint(1, len(seqs)))  # rows change hands between steps
        assert torch.equal(rows.tensor(batch), _padded(batch))


def test_a_plan_with_kept_tables_equals_the_plan_from_lists():
    seqs = []
    for i, (prompt, computed) in enumerate([(40, 39), (5, 0), (33, 32), (17, 8)]):
        s = Sequence(i, str(i), 0, list(range(10, 10 + prompt)), SamplingParams())
        s.block_table = [7 * i + j for j in range(-(-prompt // 16))]
        s.num_computed_tokens = computed
        seqs.append(s)
    rows = BlockTableRows(4, 8)
    for batch in (
        ScheduledBatch([seqs[0], seqs[2]], [1, 1]),  # decode only
        ScheduledBatch(seqs, [1, 5, 1, 9]),  # decodes and prompt chunks
        ScheduledBatch([seqs[1]], [1]),  # a one-token chunk that does not end its prompt: nothing to sample
    ):
        kept, lists = plan_step(batch, 16, rows), plan_step(batch, 16)
        assert kept.max_query_len == lists.max_query_len
        (ids_a, inputs_a, rows_a), (ids_b, inputs_b, rows_b) = (
            step_tensors(plan, torch.device("cpu"), None, hints=True) for plan in (kept, lists)
        )
        pairs = [(ids_a, ids_b), (rows_a, rows_b)]
        pairs += [(getattr(inputs_a, f), getattr(inputs_b, f)) for f in ("positions", "slot_mapping", "block_tables")]
        pairs += [(getattr(inputs_a, f), getattr(inputs_b, f)) for f in ("seq_lens", "query_start_loc")]
        for a, b in pairs:
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert inputs_a.max_seq_len == inputs_b.max_seq_len


def test_a_step_tensor_is_its_own_even_at_the_buffers_width():
    """A step's tables stay as they were when the next step rewrites the rows (as wide as the buffer, the
    slice is contiguous: it was handed out as a view of the buffer)."""
    seqs = [Sequence(i, str(i), 0, [1, 2, 3], SamplingParams()) for i in range(3)]
    for i, s in enumerate(seqs):
        s.block_table = [10 * i + j for j in range(4)]
    rows = BlockTableRows(max_rows=3, width=4)
    first = rows.tensor(seqs)
    kept = first.clone()
    for s in seqs:
        s.block_table = [99, 98, 97, 96]  # released and regrown: the next step rewrites every row
    assert torch.equal(rows.tensor(seqs), torch.full((3, 4), 0, dtype=torch.int32) + torch.tensor([99, 98, 97, 96]))
    assert torch.equal(first, kept)
