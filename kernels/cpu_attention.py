"""The CPU engine's paged attention: decode rows through one compiled kernel that reads K/V
where they lie in the pool, prompts through the reference's flash SDPA.

The reference gathers each decode's context out of the pool (`index_select`) and then lays it out
again for a batched matmul, at every layer: two copies of every context per step. Compiled by
inductor, `decode_attention` below is a few fused loops that load each key and value from its
block directly, for any batch and context length (dynamic shapes: one compilation per process and
dtype, see `kernels.compiled`).
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.compiled import Compiled


def decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """One new token per sequence: query [B, H, D], block_tables [B, W] (W blocks cover the longest
    context), seq_lens [B]. Returns [B, H, D]. Scores and the softmax in float32."""
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    positions = torch.arange(block_tables.shape[1] * block_size, device=query.device)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size  # [B, T]
    # [B, kv, 1, T, D]: the context last but one, so that the softmax runs along contiguous scores
    keys = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots].permute(0, 2, 1, 3)[:, :, None]
    values = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots].permute(0, 2, 1, 3)[:, :, None]
    q = query.view(batch, num_kv_heads, group, 1, head_dim).float()
    scores = (q * keys.float()).sum(-1) * scale  # [B, kv, group, T]
    past_end = positions[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * values.float()).sum(-2)  # [B, kv, group, D]
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def _reference_decode(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """The same through the reference (gathers, batched matmuls): where compiling fails."""
    one_each = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return reference.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, one_each, scale)


_kernel = Compiled(decode_attention, fallback=_reference_decode)


def paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """`kernels.reference.paged_attention`'s contract."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    rows = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] == 1]
    if rows:
        _decode_rows(query, k_cache, v_cache, block_tables, seq_lens, lengths, starts, rows, scale, out)
    reference.prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out)
    return out


def _decode_rows(query, k_cache, v_cache, block_tables, seq_lens, lengths, starts, rows, scale, out):
    width = -(-max(lengths[i] for i in rows) // k_cache.shape[1])
    tokens = [starts[i] for i in rows]
    if len(rows) == len(lengths) and width <= block_tables.shape[1]:  # a pure decode step: token i is sequence i's
        q, tables, lens = query, block_tables[:, :width], seq_lens
    else:
        index = torch.tensor(rows, device=query.device)
        q, tables, lens = query[tokens], block_tables[index, :width], seq_lens[index]
    # At least two rows and two blocks: a size of 1 would be compiled separately (a specialisation).
    if len(rows) == 1:
        q, tables, lens = q.repeat(2, 1, 1), tables.repeat(2, 1), lens.repeat(2)
    if width == 1:
        tables = torch.cat([tables, tables], dim=1)
    result = _kernel(q, k_cache, v_cache, tables, lens, scale)[: len(rows)]
    if len(rows) == len(lengths):
        out.copy_(result)
    else:
        out[torch.tensor(tokens, device=query.device)] = result
