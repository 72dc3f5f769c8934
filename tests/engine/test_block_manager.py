"""BlockManager on its own: reference counts, the free list, and prefix caching."""

from __future__ import annotations

import itertools

import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.params.sampling_params import SamplingParams

BS = 4  # block size used throughout
_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    return Sequence(next(_ids), f"r{next(_ids)}", 0, list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence) -> None:
    """What a step does for a sequence: hold all its tokens, compute them, register its full blocks."""
    assert bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_full_blocks(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does on admission: take the cached prefix, then grow and compute."""
    hits = bm.match_prefix(seq)
    bm.take_prefix(seq, hits)
    compute(bm, seq)
    return hits


def assert_consistent(bm: BlockManager, seqs) -> None:
    """Every block is either free (ref 0) or held; ref counts equal the number of holders."""
    holders = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            holders[b] += 1
    assert holders == bm.ref_counts
    assert set(bm.free) == {b for b in range(bm.num_blocks) if holders[b] == 0}


def test_grow_takes_blocks_from_the_free_list_with_ref_count_one():
    bm = BlockManager(8, BS)
    seq = make_seq(range(5))
    assert bm.grow(seq, 5)
    assert len(seq.block_table) == 2
    assert len(set(seq.block_table)) == 2
    assert bm.num_free_blocks == 6
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    # Growing within the last block takes nothing; crossing a boundary takes one more.
    assert bm.grow(seq, 8)
    assert len(seq.block_table) == 2
    assert bm.grow(seq, 9)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    assert_consistent(bm, [seq])


def test_grow_fails_without_taking_anything_when_the_pool_is_too_dry():
    bm = BlockManager(3, BS)
    a = make_seq(range(8))
    assert bm.grow(a, 8)
    b = make_seq(range(100, 109))
    assert not bm.grow(b, 9)  # needs 3, only 1 free
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    assert bm.grow(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_hold(b, 5)
    assert_consistent(bm, [a, b])


def test_release_returns_every_block():
    bm = BlockManager(16, BS)
    seqs = [make_seq(range(i * 50, i * 50 + 3 + 4 * i)) for i in range(3)]
    for s in seqs:
        admit(bm, s)
    assert bm.num_free_blocks == 16 - sum(len(s.block_table) for s in seqs)
    for s in seqs:
        bm.release(s)
        assert s.block_table == []
        assert s.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks == 16
    assert bm.ref_counts == [0] * 16


def test_shared_prefix_gets_the_same_blocks_without_copy():
    bm = BlockManager(16, BS)
    prefix = list(range(10, 22))  # exactly 3 full blocks
    a = make_seq(prefix + [99])
    admit(bm, a)
    free_after_a = bm.num_free_blocks
    b = make_seq(prefix + [77, 78])
    hits = admit(bm, b)
    assert hits == a.block_table[:3]
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    assert all(bm.ref_counts[blk] == 2 for blk in a.block_table[:3])
    assert bm.ref_counts[a.block_table[3]] == 1
    assert b.num_cached_tokens == 12
    # Only b's own tail block was taken from the pool.
    assert bm.num_free_blocks == free_after_a - 1
    assert_consistent(bm, [a, b])
    # Releasing one holder keeps the shared blocks held by the other.
    bm.release(a)
    assert all(bm.ref_counts[blk] == 1 for blk in b.block_table[:3])
    assert_consistent(bm, [b])
    bm.release(b)
    assert bm.num_free_blocks == 16


def test_prefix_match_stops_at_the_first_differing_block():
    bm = BlockManager(16, BS)
    a = make_seq(range(13))
    admit(bm, a)
    tokens = list(range(13))
    tokens[5] = 500  # second block differs
    b = make_seq(tokens)
    assert bm.match_prefix(b) == a.block_table[:1]


def test_a_different_earlier_block_changes_every_later_hash():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(16)))
    b = make_seq([999] + list(range(1, 16)))  # only the first token differs
    hashes_a = [bm.block_hash(a, i) for i in range(4)]
    hashes_b = [bm.block_hash(b, i) for i in range(4)]
    assert all(ha != hb for ha, hb in zip(hashes_a, hashes_b))
    admit(bm, a)
    assert bm.match_prefix(b) == []
    # Same tokens give the same hashes (the chain is deterministic).
    c = make_seq(list(range(16)))
    assert [bm.block_hash(c, i) for i in range(4)] == hashes_a


def test_match_always_leaves_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = make_seq(range(13))
    admit(bm, a)
    exact = make_seq(range(12))  # its whole prompt is cached: 3 full blocks
    hits = bm.match_prefix(exact)
    assert hits == a.block_table[:2]
    bm.take_prefix(exact, hits)
    assert exact.num_computed_tokens == 8 < len(exact)
    one_more = make_seq(range(13))
    assert bm.match_prefix(one_more) == a.block_table[:3]
    short = make_seq(range(4))  # one block, fully cached, still computes its last token
    assert bm.match_prefix(short) == []


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(16, BS)
    a = make_seq(range(10))
    assert bm.grow(a, 10)
    a.num_computed_tokens = 7  # a chunk of the prompt: one full block computed
    bm.register_full_blocks(a)
    probe = make_seq(range(11))
    assert bm.match_prefix(probe) == a.block_table[:1]
    a.num_computed_tokens = 10
    bm.register_full_blocks(a)
    assert bm.match_prefix(probe) == a.block_table[:2]


def test_freed_blocks_stay_findable_and_are_revived():
    bm = BlockManager(8, BS)
    a = make_seq(range(9))
    admit(bm, a)
    blocks = list(a.block_table)
    bm.release(a)
    assert bm.num_free_blocks == 8
    b = make_seq(range(9))
    hits = bm.match_prefix(b)
    assert hits == blocks[:2]
    # Reviving a cached free block consumes a free block, as does the new tail.
    assert bm.blocks_needed(b, 9, hits) == 3
    admit(bm, b)
    assert b.block_table[:2] == blocks[:2]
    assert b.num_cached_tokens == 8
    assert bm.num_free_blocks == 5
    assert_consistent(bm, [b])


def test_eviction_reuses_the_least_recently_freed_block_first():
    bm = BlockManager(4, BS)
    a = make_seq(range(8))
    b = make_seq(range(100, 108))
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table, bm.num_free_blocks) == ([0, 1], [2, 3], 0)
    bm.release(a)  # freed first: a's tail, then a's head
    bm.release(b)
    a_blocks, b_blocks = [1, 0], [3, 2]
    assert list(bm.free) == a_blocks + b_blocks
    # A newcomer gets the block freed earliest: a's tail.
    c = make_seq(range(200, 204))
    assert bm.grow(c, 4)
    assert c.block_table == [1]
    # a's first block is still findable, its evicted second one is not; b is untouched.
    assert bm.match_prefix(make_seq(range(9))) == [0]
    assert bm.match_prefix(make_seq(list(range(100, 108)) + [1])) == [2, 3]
    # Then a's head, and only then b's blocks.
    assert bm.grow(c, 12)
    assert c.block_table == [1, 0, 3]
    assert bm.match_prefix(make_seq(range(9))) == []
    assert bm.match_prefix(make_seq(list(range(100, 108)) + [1])) == [2]


def test_an_evicted_hash_is_no_longer_matched():
    bm = BlockManager(2, BS)
    a = make_seq(range(8))
    admit(bm, a)
    held = list(a.block_table)
    bm.release(a)
    assert len(bm.match_prefix(make_seq(range(9)))) == 2
    c = make_seq(range(300, 308))
    assert bm.grow(c, 8)  # takes both blocks, evicting both hashes
    assert sorted(c.block_table) == sorted(held)
    assert bm.match_prefix(make_seq(range(9))) == []
    assert all(h is None for h in bm.block_hashes)
    # Once c computes its blocks, they are findable under c's hashes instead.
    c.num_computed_tokens = 8
    bm.register_full_blocks(c)
    assert bm.match_prefix(make_seq(list(range(300, 308)) + [0])) == c.block_table


@pytest.mark.parametrize("enabled", [True, False])
def test_prefix_caching_can_be_disabled(enabled):
    bm = BlockManager(8, BS, enable_prefix_caching=enabled)
    a = make_seq(range(9))
    admit(bm, a)
    b = make_seq(range(9))
    assert (bm.match_prefix(b) == a.block_table[:2]) is enabled
    if not enabled:
        assert bm.match_prefix(b) == []
        assert bm.cached == {}


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(16, BS)
    parent = make_seq(range(10))  # two full blocks and two tokens
    admit(bm, parent)
    child = parent.fork(next(_ids))
    free = bm.num_free_blocks
    src, dst = bm.fork(parent, child)
    assert (src, child.block_table[:2]) == (parent.block_table[2], parent.block_table[:2])
    assert dst == child.block_table[2] and dst not in parent.block_table
    assert bm.num_free_blocks == free - 1  # only the copy
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table[:2]) and bm.ref_counts[src] == 1
    assert child.num_computed_tokens == 10 and child.token_ids == parent.token_ids
    child.append_token(77)
    parent.append_token(88)
    assert parent.token_ids[-1] == 88 and child.token_ids[-1] == 77  # histories diverge
    assert_consistent(bm, [parent, child])
    bm.release(parent)
    assert all(bm.ref_counts[b] == 1 for b in child.block_table)
    bm.release(child)
    assert bm.num_free_blocks == 16


def test_fork_on_a_block_boundary_copies_nothing():
    bm = BlockManager(16, BS)
    parent = make_seq(range(8))
    admit(bm, parent)
    child = parent.fork(next(_ids))
    assert bm.fork(parent, child) is None
    assert child.block_table == parent.block_table and child.num_computed_tokens == 8
    assert child.num_registered_blocks == parent.num_registered_blocks == 2
    child.append_token(5)
    assert bm.grow(child, len(child)) and len(child.block_table) == 3  # its own next block
    assert_consistent(bm, [parent, child])


def test_fork_with_a_dry_pool_recomputes_the_partial_block_instead():
    bm = BlockManager(3, BS)
    parent = make_seq(range(10))
    admit(bm, parent)  # all three blocks
    child = parent.fork(next(_ids))
    assert bm.fork(parent, child) is None
    assert child.block_table == parent.block_table[:2]
    assert child.num_computed_tokens == 8  # the two partial tokens are computed again
    assert_consistent(bm, [parent, child])


def test_cached_tokens_count_the_first_admission_only():
    """As vLLM: a preempted sequence recomputed from its own cached blocks reports its first admission's hits,
    so a job's cached tokens are the prefix cache's real saving (what a prefix plan predicts)."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(9))
    admit(bm, seq)
    assert seq.num_cached_tokens == 0
    bm.release(seq)  # preempted: its blocks stay findable
    seq.num_preemptions += 1
    assert len(admit(bm, seq)) == 2 and seq.num_cached_tokens == 0
    other = make_seq(range(9))
    admit(bm, other)
    assert other.num_cached_tokens == 2 * BS
