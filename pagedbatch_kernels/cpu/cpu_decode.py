"""The CPU decode kernel behind `cpu_attention`: one new token per sequence, keys and values read where they
lie in the paged pool; our C++ kernel (`cpu_native`) where it can be built, else `decode_attention` compiled by
inductor, else plain torch. `merge_partial` joins two parts of a context (a shared prefix and a tail)."""

from __future__ import annotations

import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.compiled import Compiled, first_dims
from pagedbatch_kernels.cpu import cpu_native

LANES = 16  # floats in an AVX-512 register


def decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """One new token per sequence: query [B, H, D], block_tables [B, W] (W blocks cover the longest
    context), seq_lens [B]. Returns the output [B, H, D] and the log-sum-exp of the scaled scores
    [B, H], both float32 (as the scores and the softmax).

    Written for the loops inductor makes of it: K and V are read block by block (`cache[blocks]`:
    no division of positions by the block size per element); a score's products are summed as a
    tree of LANES-wide slices before one horizontal sum (a chain of dependent vector adds was
    most of the kernel's time); the weighted values are summed within each block, then across, and
    divided by the weights' sum once per output (not once per score: ~10% of the kernel)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, width = num_heads // num_kv_heads, block_tables.shape[1]
    blocks = block_tables.long()
    # [B, kv, 1, W, block, D]: a block's positions contiguous, the query group broadcast
    keys = k_cache[blocks].permute(0, 3, 1, 2, 4)[:, :, None]
    values = v_cache[blocks].permute(0, 3, 1, 2, 4)[:, :, None]
    q = query.view(batch, num_kv_heads, group, 1, 1, head_dim).float() * scale
    scores = _tree_sum(q * keys.float()).view(batch, num_kv_heads, group, width * block_size)
    past_end = torch.arange(width * block_size, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    weighted = weights.view(batch, num_kv_heads, group, width, block_size, 1) * values.float()
    out = weighted.sum(-2).sum(-2) / total  # [B, kv, group, D]
    lse = (top + total.log()).squeeze(-1)
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def _tree_sum(products):
    """products.sum(-1), adding LANES-wide slices pairwise first where the last dimension (a head's
    size: static when compiled) splits into them."""
    size = products.shape[-1]
    if size % LANES:
        return products.sum(-1)
    parts = [products[..., i : i + LANES] for i in range(0, size, LANES)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0].sum(-1)


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint parts of a context, from each part's output and log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]


def _reference_decode(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """decode_attention through plain torch ops, for where compiling fails."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    context = block_tables.shape[1] * block_size
    keys = reference._gather_blocks("k", k_cache, block_tables.flatten().long()).view(
        batch, context, num_kv_heads, head_dim
    )
    values = reference._gather_blocks("v", v_cache, block_tables.flatten().long()).view(
        batch, context, num_kv_heads, head_dim
    )
    group = num_heads // num_kv_heads
    q = query.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,bthd->bhgt", q, keys.float()) * scale
    past_end = torch.arange(context, device=query.device)[None, :] >= seq_lens[:, None]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


# the block tables vary in width too; the pool's block count only between engines
_decode = Compiled(decode_attention, fallback=_reference_decode, varying={**first_dims(0, 1, 2, 4), 3: (0, 1)})
_merge = Compiled(merge_partial, varying=first_dims(0, 1, 2, 3))


def decode_kernel(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """`decode_attention` through the native kernel where it takes the tensors (`cpu_native`), else
    through inductor's."""
    if cpu_native.supports(query, k_cache):
        return cpu_native.decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, scale)
