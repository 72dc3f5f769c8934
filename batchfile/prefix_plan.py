"""Whole-file prefix planning: which lines run together, and in what order, so that a shared prompt prefix is
computed once per worker.

Every line's prompt is cut into the engine's full KV blocks and each block named by the engine's own chained hash
(`engine.core.block_manager.chain_hash`: equal hashes mean equal whole prefixes). Sorting the lines by their hash
chains puts lines that share a prefix next to each other, longest shared prefix nearest (a trie walked in
order); the sorted lines are cut into shards at group boundaries (a group: lines whose first block is equal),
at most `shard_size` lines and, with several workers, no more than an equal share each, so that the groups
spread over the workers and each worker warms its own prefixes once. Results stay keyed by line number, so
the output file keeps the input's order.

`expected_cached_tokens` is what the engine's prefix cache serves a shard's lines run in order on one worker:
each line's longest run of leading blocks already computed by an earlier line of the shard, less the last
block when that would leave no token to compute (the engine needs the last token's logits), as
`BlockManager.match_prefix` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.block_manager import chain_hash

DEFAULT_BLOCK_SIZE = 16  # the engine's default KV block size (engine.hf.config.EngineConfig.block_size)
FIRST_WINDOW_SHARDS = 4  # a file's first plan window: this many shards (a worker's default concurrency)


def window_lines(window: int, shard_size: int, shards_so_far: int) -> int:
    """How many valid lines the next plan window holds, `shards_so_far` shards of the file already planned.

    The first window holds FIRST_WINDOW_SHARDS shards and each next one as many lines as all before it, up
    to `window` (at least a shard): the workers start on a large file's first shards at once instead of after
    a whole window is validated (8192 lines: ~0.6 s), and the windows are soon as wide as configured."""
    ramp = shard_size * max(FIRST_WINDOW_SHARDS, shards_so_far)
    return max(min(window, ramp), shard_size)


def prompt_blocks(token_ids: Sequence[int], root: bytes, block_size: int) -> tuple[bytes, ...]:
    """The chained hashes of the prompt's full blocks; `root` keeps lines of different adapters apart."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return tuple(hashes)


@dataclass
class PlanLine:
    """What the planner needs of a valid line: its shard-input text, its size and its prompt's block hashes
    (empty when the prefix cache cannot serve it: images, embeddings, prompt logprobs)."""

    shard_line: str
    prompt_tokens: int = 0
    max_tokens: int = 0
    blocks: tuple[bytes, ...] = ()


@dataclass
class PlannedShard:
    lines: list[PlanLine] = field(default_factory=list)
    expected_cached: int = 0  # prompt tokens the prefix cache serves when the shard runs in this order


def cached_tokens_in_order(lines: Sequence[PlanLine], block_size: int) -> int:
    """Prompt tokens served from the cache when `lines` run in order on one worker whose cache keeps what they
    computed."""
    seen: set[bytes] = set()
    total = 0
    for line in lines:
        hits = 0
        for h in line.blocks:
            if h not in seen:
                break
            hits += 1
        if hits and hits * block_size >= line.prompt_tokens:
            hits -= 1
        total += hits * block_size
        seen.update(line.blocks)
    return total


def prefix_groups(lines: Sequence[PlanLine]) -> list[list[PlanLine]]:
    """Lines sharing their first block, each group where its first line is in the file and sorted by hash chain
    inside (longest shared prefixes adjacent); an uncacheable line is a group alone. Nothing shared: file order."""
    groups: dict[object, list[PlanLine]] = {}
    for i, line in enumerate(lines):
        groups.setdefault(line.blocks[0] if line.blocks else i, []).append(line)
    return [sorted(group, key=lambda line: line.blocks) if len(group) > 1 else group for group in groups.values()]


def plan_shards(
    lines: list[PlanLine], *, shard_size: int, workers: int = 1, block_size: int = DEFAULT_BLOCK_SIZE, planned=True
) -> list[PlannedShard]:
    """Cut `lines` into shards: grouped by shared prefix and spread over `workers` when `planned`, else in
    file order (`shard_size` lines each; also when no prefix is shared). Each shard carries the cached tokens it
    should get."""
    if not lines:
        return []
    groups = prefix_groups(lines) if planned else []
    if any(len(group) > 1 for group in groups):
        # whole groups per shard, and at least one shard per worker: each worker warms its own prefixes
        target = min(shard_size, -(-len(lines) // max(1, workers)))
        shards: list[list[PlanLine]] = [[]]
        for group in groups:
            if shards[-1] and len(shards[-1]) + len(group) > target:
                shards.append([])
            for start in range(0, len(group), target):  # a group bigger than a shard: cut in shard-sized pieces
                if shards[-1] and start:
                    shards.append([])
                shards[-1].extend(group[start : start + target])
    else:
        shards = [lines[i : i + shard_size] for i in range(0, len(lines), shard_size)]
    return [PlannedShard(shard, cached_tokens_in_order(shard, block_size)) for shard in shards]
