"""Neox-style rotary embedding (rotate halves) for query and key in one launch.

One program per token: it loads cos/sin for the token's position once and rotates every
query head and every key head of that token. Returns new tensors, like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    token,
    num_heads,
    half,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < half)
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + cols[None, :]
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < half
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        token,
        num_q_heads,
        half,
        cos,
        sin,
        BLOCK_QH,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        token,
        num_k_heads,
        half,
        cos,
        sin,
        BLOCK_KH,
        BLOCK_HALF,
    )


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, Hkv, D], positions [T], cos_sin_cache [max_pos, D] = cat(cos, sin)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        half,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=max(triton.next_power_of_2(half), 8),
        num_warps=4,
    )
    return q_out, k_out
