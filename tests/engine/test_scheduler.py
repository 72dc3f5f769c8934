"""The Scheduler driven by hand: no model, the engine's bookkeeping simulated here."""

from __future__ import annotations

import itertools

from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.params.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int = 4, start: int | None = None) -> Sequence:
    """A sequence with a prompt of distinct tokens (no accidental prefix sharing)."""
    sid = next(_ids)
    base = 1000 * sid if start is None else start
    return Sequence(
        sid,
        f"req{sid}",
        0,
        list(range(base, base + prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def make(num_blocks=64, max_num_seqs=8, budget=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget)


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step: schedule, 'compute' the scheduled tokens, sample one token for
    every sequence that reached its end, and finish those at max_tokens."""
    batch = sched.schedule()
    check_batch(sched, batch)
    done = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        reaches_end = seq.num_computed_tokens + n == len(seq)
        seq.num_computed_tokens += n
        sched.block_manager.register_full_blocks(seq)
        if reaches_end:
            seq.append_token(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                done.append(seq)
    for seq in done:
        sched.finish(seq)
    return batch


def check_batch(sched: Scheduler, batch: ScheduledBatch) -> None:
    """Invariants of every scheduled batch."""
    bm = sched.block_manager
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(batch.seqs) <= sched.max_num_seqs
    assert len(set(id(s) for s in batch.seqs)) == len(batch.seqs)
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= n <= len(seq) - seq.num_computed_tokens
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
    assert len(sched.running) <= sched.max_num_seqs
    held = [0] * bm.num_blocks
    for seq in sched.running:
        for b in seq.block_table:
            held[b] += 1
    assert held == bm.ref_counts
    assert all(not s.block_table for s in sched.waiting)


def run_all(sched: Scheduler, max_steps: int = 500) -> list[ScheduledBatch]:
    batches = []
    while sched.has_work():
        batches.append(step(sched))
        assert len(batches) < max_steps, "scheduler made no progress"
    return batches


def test_every_step_respects_the_token_budget_and_all_finish():
    sched = make(budget=16)
    seqs = [make_seq(n, max_tokens=3) for n in (5, 40, 1, 17, 16, 9, 33)]
    for s in seqs:
        sched.add(s)
    batches = run_all(sched)
    assert all(b.num_tokens <= 16 for b in batches)
    assert any(b.num_tokens == 16 for b in batches)  # the budget is used, not just respected
    for s in seqs:
        assert s.is_finished and s.num_output_tokens == 3
        assert s.block_table == []
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    # Each prompt token and each output token but the last was computed exactly once.
    assert sum(b.num_tokens for b in batches) == sum(s.num_prompt_tokens + 2 for s in seqs)


def test_long_prompt_is_chunked_while_decodes_keep_one_token_per_step():
    sched = make(budget=10)
    decoders = [make_seq(3, max_tokens=30), make_seq(4, max_tokens=30)]
    for s in decoders:
        sched.add(s)
    step(sched)  # both prefill in one step (7 tokens)
    assert all(s.num_output_tokens == 1 for s in decoders)
    long = make_seq(50, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        batch = step(sched)
        got = dict(zip(map(id, batch.seqs), batch.num_new_tokens))
        for d in decoders:
            assert got[id(d)] == 1  # a decode gets its token in every step
        chunks.append(got[id(long)])
        assert batch.num_tokens == 10 or long.num_output_tokens == 1
    assert sum(chunks) == 50
    assert len(chunks) == 7  # 8 tokens per step beside the two decodes: ceil(50 / 8)
    assert chunks[:-1] == [8] * 6
    assert all(s.num_output_tokens == 1 + len(chunks) for s in decoders)


def test_running_sequences_go_first_in_arrival_order():
    sched = make(budget=64)
    a, b = make_seq(5, max_tokens=10), make_seq(6, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    c = make_seq(7, max_tokens=10)
    sched.add(c)
    batch = step(sched)
    assert batch.seqs == [a, b, c]
    assert batch.num_new_tokens == [1, 1, 7]


def test_fifo_admission_a_waiting_request_is_never_overtaken():
    # 10 blocks of 4: `big` cannot fit beside `first`, and `small` behind it must wait too.
    sched = make(num_blocks=10, budget=64)
    first = make_seq(20, max_tokens=3)  # 6 blocks by the end
    big = make_seq(24, max_tokens=2)  # 7 blocks
    small = make_seq(2, max_tokens=2)  # would fit at any time
    for s in (first, big, small):
        sched.add(s)
    admitted_order = []
    steps = 0
    while sched.has_work():
        batch = step(sched)
        steps += 1
        admitted_order += [s for s in batch.seqs if s not in admitted_order]
        if big.status is SequenceStatus.WAITING:
            assert small.status is SequenceStatus.WAITING, "small overtook big"
    assert admitted_order == [first, big, small]
    assert steps > 3  # big really had to wait for first to finish


def test_max_num_seqs_caps_the_running_set():
    sched = make(max_num_seqs=2, budget=64)
    seqs = [make_seq(3, max_tokens=2) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    order = []
    while sched.has_work():
        batch = step(sched)
        assert len(sched.running) <= 2 and len(batch.seqs) <= 2
        order += [s for s in batch.seqs if s not in order]
    assert order == seqs


def test_admission_stops_when_the_budget_is_spent():
    sched = make(budget=8)
    a, b = make_seq(8, max_tokens=2), make_seq(3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == []


def test_preemption_of_the_newest_and_its_readmission_first():
    # 4 blocks of 4 tokens; two 7-token prompts take 2 blocks each, the pool is then full.
    sched = make(num_blocks=4, budget=64)
    bm = sched.block_manager
    old, new = make_seq(7, max_tokens=6), make_seq(7, max_tokens=6)
    sched.add(old)
    sched.add(new)
    step(sched)  # prefill both: 8 tokens each after sampling, 2 blocks each
    assert bm.num_free_blocks == 0
    late = make_seq(2, max_tokens=1)  # arrives while the pool is full
    sched.add(late)
    step(sched)  # decode: 8 tokens fit in 2 blocks; nobody can be admitted
    assert late.status is SequenceStatus.WAITING
    assert len(old) == len(new) == 9
    batch = step(sched)  # old needs a third block: the newest running seq is preempted
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [new, late]  # back at the head of the queue
    assert batch.seqs == [old]  # no admission in a step that had to preempt
    assert len(old.block_table) == 3
    assert len(new) == 9  # its generated tokens are kept, to be recomputed
    # Run on: new is re-admitted before late, and everything completes.
    admitted_after = []
    while sched.has_work():
        b = step(sched)
        admitted_after += [s for s in b.seqs if s in (new, late) and s not in admitted_after]
    assert admitted_after == [new, late]
    assert old.num_output_tokens == new.num_output_tokens == 6
    assert bm.num_free_blocks == bm.num_blocks


def test_a_lone_sequence_that_outgrows_the_pool_preempts_itself():
    sched = make(num_blocks=2, budget=64)
    seq = make_seq(7, max_tokens=5)
    sched.add(seq)
    step(sched)
    step(sched)
    assert seq.status is SequenceStatus.RUNNING and len(seq) == 9
    batch = step(sched)  # 9 tokens need a third block that does not exist
    assert not batch
    assert seq.status is SequenceStatus.WAITING
    assert seq.block_table == [] and sched.running == []
    assert sched.block_manager.num_free_blocks == 2


def test_finish_returns_blocks_at_once():
    sched = make(num_blocks=16, budget=64)
    bm = sched.block_manager
    a, b = make_seq(9, max_tokens=50), make_seq(5, max_tokens=50)
    sched.add(a)
    sched.add(b)
    step(sched)
    held_by_a = len(a.block_table)
    free_before = bm.num_free_blocks
    sched.finish(a)
    assert bm.num_free_blocks == free_before + held_by_a
    assert a.is_finished and a not in sched.running and a.block_table == []
    # A waiting sequence can be finished (aborted) too.
    w = make_seq(3)
    sched.add(w)
    sched.finish(w)
    assert w.is_finished and w not in sched.waiting
    batch = step(sched)
    assert batch.seqs == [b]
    sched.finish(b)
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_work()


def test_shared_prefix_is_not_recomputed_on_admission():
    sched = make(num_blocks=32, budget=64)
    a = make_seq(13, max_tokens=5, start=0)
    sched.add(a)
    step(sched)
    b = make_seq(14, max_tokens=2, start=0)  # same first 13 tokens
    sched.add(b)
    batch = step(sched)
    n_b = dict(zip(map(id, batch.seqs), batch.num_new_tokens))[id(b)]
    assert n_b == 14 - 12  # three cached blocks
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 12
    run_all(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_with_lora_a_step_groups_its_sequences_by_adapter_in_their_order():
    sched = Scheduler(BlockManager(64, BS), 8, 64, max_loras=3)
    seqs = [make_seq(3, max_tokens=4) for _ in range(7)]
    for seq, lora_id in zip(seqs, [2, 0, 1, 2, 0, 3, 1]):
        seq.lora_id = lora_id
        sched.add(seq)
    first = step(sched)  # every prefill
    later = step(sched)  # every decode
    grouped = [seqs[i] for i in (1, 4, 2, 6, 0, 3, 5)]
    for batch in (first, later):
        assert batch.seqs == grouped
    assert first.num_new_tokens == [3] * 7 and later.num_new_tokens == [1] * 7
    plain = make(budget=64)  # without LoRA: arrival order
    for seq in (a := [make_seq(3) for _ in range(3)]):
        seq.lora_id = 0
        plain.add(seq)
    assert step(plain).seqs == a
