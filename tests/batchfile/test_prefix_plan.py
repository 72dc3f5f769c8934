"""Whole-file prefix planning: lines sharing a prefix grouped into shards, spread over workers, and the cached
tokens the plan expects computed as the engine's prefix cache serves them."""

from __future__ import annotations

import random

from batchfile.prefix_plan import PlanLine, cached_tokens_in_order, plan_shards, prompt_blocks, window_lines
from engine.core.block_manager import BlockManager, chain_hash, first_parent
from engine.core.sequence import Sequence
from engine.params.sampling_params import SamplingParams

BS = 4


def _line(ids: list[int], tag: str = "") -> PlanLine:
    return PlanLine(f"{tag or ids}\n", len(ids), 8, prompt_blocks(ids, b"m", BS))


def test_block_hashes_are_the_engines():
    ids = list(range(10))
    parent = first_parent(0)
    expected = []
    for i in range(2):
        parent = chain_hash(parent, ids[i * BS : (i + 1) * BS])
        expected.append(parent)
    assert prompt_blocks(ids, b"", BS) == tuple(expected)  # full blocks only: 2 of 10 tokens' 3


def test_nothing_shared_keeps_file_order_and_shard_size():
    lines = [_line([i] * 9) for i in range(10)]
    shards = plan_shards(lines, shard_size=4, workers=2, block_size=BS)
    assert [s.lines for s in shards] == [lines[0:4], lines[4:8], lines[8:10]]
    assert all(s.expected_cached == 0 for s in shards)


def test_shared_prefixes_grouped_per_shard_and_spread_over_workers():
    rng = random.Random(0)
    systems = [[100 + g] * 8 for g in range(4)]  # 2 full blocks each
    lines = [_line(systems[g] + [rng.randrange(50)] * 3, f"{g}-{i}") for g in range(4) for i in range(6)]
    rng.shuffle(lines)
    shards = plan_shards(lines, shard_size=100, workers=2, block_size=BS)
    assert len(shards) == 2 and sorted(len(s.lines) for s in shards) == [12, 12]
    groups = [{line.shard_line.split("-")[0] for line in s.lines} for s in shards]
    assert groups[0].isdisjoint(groups[1])  # each prefix warmed by one worker
    assert sum(s.expected_cached for s in shards) == 4 * 5 * 8  # each line after a group's first: 8 tokens
    unplanned = plan_shards(lines, shard_size=100, workers=2, block_size=BS, planned=False)
    assert sorted(line.shard_line for s in shards for line in s.lines) == sorted(line.shard_line for line in lines)
    assert [line for s in unplanned for line in s.lines] == lines


def test_a_group_bigger_than_a_shard_is_cut():
    lines = [_line([7] * 8 + [i], str(i)) for i in range(10)]
    shards = plan_shards(lines, shard_size=4, workers=1, block_size=BS)
    assert [len(s.lines) for s in shards] == [4, 4, 2]
    assert [s.expected_cached for s in shards] == [3 * 8, 3 * 8, 8]


def test_expected_cached_matches_the_block_manager():
    """The plan's count equals what BlockManager.match_prefix serves, a whole-prompt hit included (the last
    token is always computed)."""
    rng = random.Random(1)
    prompts = [[1] * 8 + [rng.randrange(9) for _ in range(rng.randrange(0, 9))] for _ in range(20)]
    prompts += [[1] * 8, [1] * 8 + [2] * 4]
    manager = BlockManager(num_blocks=400, block_size=BS)
    served = 0
    for n, ids in enumerate(prompts):
        seq = Sequence(n, str(n), 0, ids, SamplingParams())
        hits = manager.match_prefix(seq)
        manager.take_prefix(seq, hits)
        assert manager.grow(seq, len(ids))
        seq.num_computed_tokens = len(ids)
        manager.register_full_blocks(seq)
        served += len(hits) * BS
    lines = [PlanLine("", len(ids), 0, prompt_blocks(ids, b"", BS)) for ids in prompts]
    assert cached_tokens_in_order(lines, BS) == served > 0


def test_a_files_first_windows_are_small_then_double_up_to_the_configured_width():
    # 256-line shards, 8192-line windows: 4 shards first, then as many lines as all before, then 8192
    widths, shards = [], 0
    for _ in range(7):
        widths.append(window_lines(8192, 256, shards))
        shards += widths[-1] // 256
    assert widths == [1024, 1024, 2048, 4096, 8192, 8192, 8192]
    assert window_lines(1, 256, 0) == 256  # at most a shard configured: a shard at a time
    assert window_lines(1000, 8, 0) == 32  # a small file fits its first window whole
