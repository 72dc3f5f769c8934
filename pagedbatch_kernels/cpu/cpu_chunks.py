"""Attention of short prompt chunks (a prompt's tail after a cached prefix, say) over the part of
the context that their decode call does not take from a shared prefix: every chunk's rows at once.

The decode kernel takes each of a chunk's tokens as a row of its own, so it reads and scores the
chunk's context once per token: in a step admitting a hundred requests whose 40-token tails follow
a shared system prompt, that was most of the step's attention time. Here the chunk's blocks are
gathered once, and its queries score them in one matrix product per KV head (all chunks of a
batch in one `bmm`, in the cache's dtype: AMX for bfloat16), with a compiled masked softmax that
lets each row see its own positions only, and a second `bmm` with the values. Chunks are batched
in order of context length, each batch's scores bounded by SCORES_LIMIT elements and its padding
by MAX_PADDING; a chunk too large for that alone stays with the decode kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedbatch_kernels.compiled import Compiled
from pagedbatch_kernels.cpu.cpu_prefix import softmax_and_lse

SCORES_LIMIT = 1 << 22  # scores of one batched call (x the dtype's bytes, plus as many float32)
MAX_PADDING = 2.0  # a batch computes at most this many times its chunks' own scores


def masked_weights_and_lse(scores, scale, visible):
    """softmax(scores * scale) of [matrices, rows, positions] over each row's first `visible`
    ([matrices, rows]) positions, in the scores' dtype, and its log-sum-exp in float32."""
    hidden = torch.arange(scores.shape[-1], device=scores.device) >= visible[..., None]
    return softmax_and_lse((scores.float() * scale).masked_fill(hidden, float("-inf")), scores.dtype)


_masked_weights_and_lse = Compiled(masked_weights_and_lse, varying={0: (0, 1, 2), 2: (0, 1)})


@dataclass
class ChunkBatch:
    """Chunks computed in one batched call: `rows` [n, Q] each chunk's rows (its last one repeated past
    its end), `blocks` [n, W] the blocks of its context (block 0 past its end), `visible` [n x KV heads,
    Q x query heads per KV head] the positions each query sees, `picks` where each real row lies among
    the n x Q."""

    rows: torch.Tensor
    blocks: torch.Tensor
    visible: torch.Tensor
    picks: torch.Tensor


def chunk_attention(query, k_cache, v_cache, batch: ChunkBatch, scale):
    """Attention of the rows of `batch` and its log-sum-exp, both float32, in the batch's row order."""
    count, height = batch.rows.shape
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, length = num_heads // num_kv_heads, batch.blocks.shape[1] * block_size
    matrices = count * num_kv_heads
    queries = (
        query[batch.rows]
        .view(count, height, num_kv_heads, group, head_dim)
        .transpose(1, 2)
        .reshape(matrices, height * group, head_dim)
        .to(k_cache.dtype)
    )
    blocks = batch.blocks.flatten()
    keys = k_cache.index_select(0, blocks).view(count, length, num_kv_heads, head_dim).permute(0, 2, 3, 1)
    values = v_cache.index_select(0, blocks).view(count, length, num_kv_heads, head_dim).transpose(1, 2)
    scores = torch.bmm(queries, keys.reshape(matrices, head_dim, length))
    weights, lse = _masked_weights_and_lse(scores, scale, batch.visible)
    out = torch.bmm(weights, values.reshape(matrices, length, head_dim))
    out = (
        out.view(count, num_kv_heads, height, group, head_dim)
        .transpose(1, 2)
        .reshape(count * height, num_heads, head_dim)
    )
    lse = lse.view(count, num_kv_heads, height, group).transpose(1, 2).reshape(count * height, num_heads)
    return out[batch.picks].float(), lse[batch.picks]


@dataclass
class Chunk:
    """A chunk's rows (indices into its decode call's rows, in order), their context lengths (the
    last the longest) and the blocks that hold those contexts."""

    rows: list[int]
    lens: list[int]
    blocks: list[int]


def plan_chunks(
    chunks: list[Chunk], num_heads: int, num_kv_heads: int, block_size: int, device
) -> tuple[list[ChunkBatch], list[Chunk]]:
    """Batches of `chunks`, and the chunks left out (too large alone for SCORES_LIMIT)."""

    def positions(chunk):  # the context its scores cover: whole blocks
        return -(-chunk.lens[-1] // block_size) * block_size

    left_out = [c for c in chunks if len(c.rows) * positions(c) * num_heads > SCORES_LIMIT]
    kept = [c for c in chunks if len(c.rows) * positions(c) * num_heads <= SCORES_LIMIT]
    # a batch's scores: its size x its most rows x its longest context; kept as running maxima and sums
    # (a step admitting hundreds of chunks made the batch-by-batch recount quadratic)
    batches, current, most_rows, most_positions, own = [], [], 0, 0, 0
    for chunk in sorted(kept, key=lambda c: (c.lens[-1], len(c.rows))):
        rows, width = len(chunk.rows), positions(chunk)
        trial = (max(most_rows, rows), max(most_positions, width), own + rows * width)
        scores = (len(current) + 1) * trial[0] * trial[1] * num_heads
        if current and (scores > SCORES_LIMIT or scores > MAX_PADDING * trial[2] * num_heads):
            batches.append(current)
            current, trial = [], (rows, width, rows * width)
        current.append(chunk)
        most_rows, most_positions, own = trial
    if current:
        batches.append(current)
    group = num_heads // num_kv_heads
    return [_batch(members, num_kv_heads, group, block_size, device) for members in batches], left_out


def _batch(members: list[Chunk], num_kv_heads: int, group: int, block_size: int, device) -> ChunkBatch:
    # a single matrix would be compiled apart (a size of one is specialised): compute the chunk twice
    computed = members * 2 if len(members) * num_kv_heads == 1 else members
    height = max(len(c.rows) for c in computed)
    width = -(-max(c.lens[-1] for c in computed) // block_size)
    rows = [c.rows + c.rows[-1:] * (height - len(c.rows)) for c in computed]
    blocks = [c.blocks[:width] + [0] * (width - len(c.blocks[:width])) for c in computed]
    lens = [c.lens + c.lens[-1:] * (height - len(c.rows)) for c in computed]
    visible = torch.tensor([[n for n in row_lens for _ in range(group)] for row_lens in lens], dtype=torch.int32)
    picks = [i * height + r for i, c in enumerate(members) for r in range(len(c.rows))]
    return ChunkBatch(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        # made in its final shape (repeat, not expand): a view's base would be guarded too
        visible=visible.repeat_interleave(num_kv_heads, dim=0).to(device),
        picks=torch.tensor(picks, dtype=torch.long, device=device),
    )
