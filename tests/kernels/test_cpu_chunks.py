"""Short prompt chunks' attention by chunk (`pagedbatch_kernels.cpu.cpu_chunks`) in the CPU engine's decode calls:
equal to the naive attention, with and without shared prefixes, beside single decodes, in batches
that respect their bounds, and handing back to the decode kernel what does not fit."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels.cpu import cpu_attention, cpu_chunks
from tests.kernels.test_reference import make_batch, naive

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# decodes, chunks after a cached context of 2..64 tokens (one of exactly a block), a long prompt
STEP = ([1, 5, 1, 40, 2, 64, 1, 17, 120], [70, 16, 3, 200, 33, 9, 15, 48, 0])


def share_first_blocks(batch, rows, blocks):
    """Sequences `rows` start with the first `blocks` blocks of the first of them."""
    tables = batch["block_tables"].clone()
    tables[rows[1:], :blocks] = tables[rows[0], :blocks]
    return {**batch, "block_tables": tables}


def kernel_rows(plan) -> int:
    return sum(
        sum(part.count for part in call.kernels) if call.order is not None else call.count for call in plan.calls
    )


def batched_shapes(plan) -> list[tuple[int, int]]:
    return [tuple(b.rows.shape) for call in plan.calls for b in call.chunks]


def plan_of(batch):
    return cpu_attention.plan_decodes(
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        batch["k_cache"].shape[1],
        (batch["query"].shape[1], batch["k_cache"].shape[2]),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("shared", [False, True], ids=["apart", "shared-prefix"])
def test_chunks_equal_naive(heads, dtype, shared):
    batch = make_batch(*STEP, *heads, dtype, seed=7)
    if shared:  # a system prompt of 3 blocks under decodes and chunks alike
        batch = share_first_blocks(batch, [0, 1, 3, 4, 7], 1)
    plan = plan_of(batch)
    chunked = [c for c in plan.calls if c.chunks]
    assert chunked, "the chunks went through the decode kernel"
    assert kernel_rows(plan) == 3  # the kernel keeps the single decodes only
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=TOL[dtype], rtol=TOL[dtype])


def test_a_call_of_chunks_only_needs_no_kernel():
    batch = make_batch([3, 9, 30], [20, 0, 50], 6, 2, torch.float32, seed=1)
    calls = plan_of(batch).calls
    assert calls and all(call.chunks and not call.kernels for call in calls)
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)


def test_one_decode_beside_chunks_is_computed_twice_not_compiled_apart():
    batch = share_first_blocks(make_batch([1, 9], [40, 20], 6, 2, torch.float32, seed=2), [0, 1], 1)
    (call,) = plan_of(batch).calls
    (part,) = call.kernels
    assert part.count == 1 and part.rows.shape[0] == 2
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)


def test_a_chunk_too_large_for_a_batch_stays_with_the_kernel(monkeypatch):
    batch = make_batch([1, 4, 60], [10, 5, 300], 6, 2, torch.bfloat16, seed=3)
    # the 4-token chunk's scores fit, the 60-token one over its 360-token context does not
    monkeypatch.setattr(cpu_chunks, "SCORES_LIMIT", 4 * 6 * 16)
    plan = plan_of(batch)
    assert batched_shapes(plan) == [(1, 4)] and kernel_rows(plan) == 61
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=3e-2, rtol=3e-2)


def test_batches_respect_the_padding_and_scores_bounds(monkeypatch):
    chunks = [
        cpu_chunks.Chunk(list(range(10 * i, 10 * i + q)), [n - q + 1 + j for j in range(q)], [i] * 40)
        for i, (q, n) in enumerate([(2, 20), (3, 30), (60, 600), (64, 610), (5, 25)])
    ]
    monkeypatch.setattr(cpu_chunks, "SCORES_LIMIT", 64 * 624 * 6 * 2)  # contexts in whole blocks
    batches, left_out = cpu_chunks.plan_chunks(chunks, 6, 2, 16, "cpu")
    assert left_out == []
    members = [sorted(b.rows[:, 0].tolist()) for b in batches]
    # the small chunks together; the two long ones together (each alone would be no cheaper)
    assert members == [[0, 10, 40], [20, 30]]
    for batch in batches:
        count, height = batch.rows.shape
        width = batch.blocks.shape[1] * 16
        assert count * height * width * 6 <= cpu_chunks.SCORES_LIMIT
    monkeypatch.setattr(cpu_chunks, "SCORES_LIMIT", 60 * 608 * 6)  # now the longest does not fit at all
    batches, left_out = cpu_chunks.plan_chunks(chunks, 6, 2, 16, "cpu")
    assert [c.rows[0] for c in left_out] == [30] and len(batches) == 2


def _batches_by_recount(chunks, num_heads, block_size):
    """The batching rule written plainly: each chunk in context order joins the current batch unless the
    batch with it would pass SCORES_LIMIT or MAX_PADDING times its chunks' own scores."""

    def positions(c):
        return -(-c.lens[-1] // block_size) * block_size

    def scores(members):
        return len(members) * max(len(c.rows) for c in members) * max(positions(c) for c in members) * num_heads

    batches, current = [], []
    for chunk in sorted(
        (c for c in chunks if scores([c]) <= cpu_chunks.SCORES_LIMIT), key=lambda c: (c.lens[-1], len(c.rows))
    ):
        trial = current + [chunk]
        own = sum(len(c.rows) * positions(c) for c in trial) * num_heads
        if current and (scores(trial) > cpu_chunks.SCORES_LIMIT or scores(trial) > cpu_chunks.MAX_PADDING * own):
            batches.append(current)
            trial = [chunk]
        current = trial
    return [[c.rows[0] for c in batch] for batch in batches + [current] if batch]


@pytest.mark.parametrize("seed", range(6))
def test_batches_are_those_of_the_plain_rule(monkeypatch, seed):
    """The planner keeps running maxima and sums (a step of hundreds of chunks was quadratic): the batches
    must be exactly those of the rule recounted batch by batch, at any mix of sizes and limits."""
    gen = torch.Generator().manual_seed(seed)
    chunks, start = [], 0
    for _ in range(int(torch.randint(1, 300, (1,), generator=gen))):
        q, context = int(torch.randint(2, 40, (1,), generator=gen)), int(torch.randint(1, 900, (1,), generator=gen))
        chunks.append(cpu_chunks.Chunk(list(range(start, start + q)), [context + j for j in range(q)], [0]))
        start += q
    monkeypatch.setattr(cpu_chunks, "SCORES_LIMIT", int(torch.randint(20_000, 4_000_000, (1,), generator=gen)))
    batches, left_out = cpu_chunks.plan_chunks(chunks, 4, 2, 16, "cpu")
    got = [[b.rows[i, 0].item() for i in range(b.rows.shape[0])] for b in batches]
    assert got == _batches_by_recount(chunks, 4, 16)
    assert len(chunks) < 20 or len(got) > 1  # the bounds were met, not only the trivial batch
    assert {c.rows[0] for c in left_out} == {
        c.rows[0] for c in chunks if len(c.rows) * -(-c.lens[-1] // 16) * 16 * 4 > cpu_chunks.SCORES_LIMIT
    }


def test_each_row_sees_its_own_positions_only():
    """The mask: a chunk's first row sees one position less than its second, padded rows repeat the
    last one, and the rows of a shorter chunk in the batch stop at its own context."""
    chunks = [cpu_chunks.Chunk([0, 1], [5, 6], [7]), cpu_chunks.Chunk([2, 3, 4], [9, 10, 11], [8])]
    (batch,), _ = cpu_chunks.plan_chunks(chunks, 4, 2, 16, "cpu")
    assert batch.rows.tolist() == [[0, 1, 1], [2, 3, 4]]
    # [chunks x KV heads, rows x query heads per KV head]
    assert batch.visible.tolist() == [[5, 5, 6, 6, 6, 6]] * 2 + [[9, 9, 10, 10, 11, 11]] * 2
    assert batch.picks.tolist() == [0, 1, 3, 4, 5]
    scores = torch.zeros(4, 6, 16)
    weights, lse = cpu_chunks.masked_weights_and_lse(scores, 1.0, batch.visible)
    assert torch.equal((weights > 0).sum(-1), batch.visible.long())
    torch.testing.assert_close(lse, batch.visible.float().log())


def test_decodes_sharing_a_prefix_with_tails_of_very_different_lengths_split_by_width():
    batch = share_first_blocks(
        make_batch([1] * 6, [40, 300, 45, 290, 50, 35], 6, 2, torch.float32, seed=4), list(range(6)), 2
    )
    (call,) = plan_of(batch).calls
    assert len(call.prefixes) == 1 and len(call.kernels) >= 2 and not call.chunks
    assert sorted(r for part in call.kernels for r in part.rows[: part.count].tolist()) == list(range(6))
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)
