"""Grouping a step's (token, choice) rows by expert for the fused MoE kernel, on the device with no
host read (so a CUDA graph can hold it), and the kernel's plain-torch twin.

`align(ids, num_experts, block)` sorts the T*k flat rows (row r = token r // k, choice r % k) by expert
and pads each expert's run to a multiple of `block`, so that every block of rows belongs to one expert.
Sizes depend only on T, k, the number of experts and `block` (an upper bound, padded with the
sentinel row T*k), never on the routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def align(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids [padded] int32: each slot's flat row or T*k for padding; block experts [padded / block]
    int32: each block's expert or `num_experts` for a block of padding only)."""
    flat = ids.reshape(-1).to(torch.int64)
    rows = flat.numel()
    capacity = -(-(rows + num_experts * (block - 1)) // block) * block
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    slot = padded_starts[expert_of] + torch.arange(rows, device=ids.device) - starts[expert_of]
    row_ids = torch.full((capacity,), rows, dtype=torch.int32, device=ids.device)
    row_ids.scatter_(0, slot, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block, device=ids.device)
    ends = torch.cumsum(padded, 0)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)  # num_experts past the end
    return row_ids, block_experts


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: int = 16,
) -> torch.Tensor:
    """The Triton kernel's twin: sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (SwiGLU experts,
    `gate_up` [E, 2I, H] gate rows first, `down` [E, H, I]), block by block of `align`'s grouping,
    float32 accumulation, [T, H] in x's dtype."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts = gate_up.shape[0]
    row_ids, block_experts = align(ids, num_experts, block)
    out = torch.zeros(tokens * top_k + 1, hidden, dtype=torch.float32, device=x.device)
    flat_weights = torch.cat([weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)])
    x_rows = torch.cat([x, x.new_zeros(1, hidden)])
    for b, expert in enumerate(block_experts.tolist()):
        if expert >= num_experts:
            continue
        rows = row_ids[b * block : (b + 1) * block].long()
        a = x_rows[torch.where(rows < tokens * top_k, rows // top_k, tokens)].float()
        h = (a @ gate_up[expert].float().T).to(x.dtype).float()
        gate, up = h.chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype).float()
        out[rows] = (h @ down[expert].float().T) * flat_weights[rows].unsqueeze(1)
    return out[:-1].reshape(tokens, top_k, hidden).sum(1).to(x.dtype)
