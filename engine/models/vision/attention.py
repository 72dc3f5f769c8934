"""Qwen2.5-VL's vision attention in one call per block: the block's windows (or, in the
full-attention blocks, its whole images) padded into one batch with the padded keys masked.
transformers' SDPA path runs one attention call per window, hundreds per block for a step's images;
the projections and the 2-D rotary stay the tower's own."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention within each run [cu_seqlens[i], cu_seqlens[i + 1]) of q, k, v ([T, heads, dim])."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts, lengths = cu_seqlens[:-1][lengths > 0], lengths[lengths > 0]
    offsets = torch.arange(int(lengths.max()), device=q.device)
    valid = offsets[None, :] < lengths[:, None]  # [runs, longest]
    index = (starts[:, None] + offsets[None, :]).masked_fill(~valid, 0)

    def batched(x):
        return x[index].transpose(1, 2)  # [runs, heads, longest, dim]

    out = F.scaled_dot_product_attention(
        batched(q), batched(k), batched(v), attn_mask=valid[:, None, None, :], scale=scale
    )
    return out.transpose(1, 2)[valid]  # the valid rows, in run order: the input order


def _forward(self, hidden_states, cu_seqlens, position_embeddings=None, **_kwargs):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    tokens = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1).unbind(1)
    q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
    return self.proj(varlen_attention(q, k, v, cu_seqlens.to(q.device), self.scaling).reshape(tokens, -1))


def batch_windows(tower) -> None:
    """Run every block of a transformers Qwen2.5-VL vision tower through `varlen_attention`."""
    for block in tower.blocks:
        block.attn.forward = types.MethodType(_forward, block.attn)
