"""The batched LoRA delta as two Triton kernels, one row per program (vLLM's "bgmv" shape): `shrink`
multiplies each row by its slot's A ([R, K]), `expand` multiplies that by its slot's B ([N, R]) and
adds it to the base layer's output in place. Rows of slot 0 (the base model) load nothing and add
nothing. No host read, so a CUDA graph could hold it. `lora_reference.lora_delta` is its twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K, BLOCK_N = 64, 64


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    k_end = tl.where(slot != 0, K, 0)  # a base-model row loads nothing
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + ks, mask=ks < k_end, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :],
            mask=(ranks[:, None] < R) & (ks[None, :] < k_end),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + t * R + ranks, acc, mask=ranks < R)


@triton.jit
def _expand(
    shrunk_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    N,
    R,
    stride_yt,
    stride_bs,
    stride_bn,
    stride_br,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n_end = tl.where(slot != 0, N, 0)  # a base-model row loads and stores nothing
    ranks = tl.arange(0, BLOCK_R)
    s = tl.load(shrunk_ptr + t * R + ranks, mask=ranks < R, other=0.0)
    b = tl.load(
        b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :] * stride_br,
        mask=(cols[:, None] < n_end) & (ranks[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1)
    keep = cols < n_end
    y = tl.load(y_ptr + t * stride_yt + cols, mask=keep, other=0.0)
    tl.store(y_ptr + t * stride_yt + cols, (y.to(tl.float32) + delta).to(y.dtype), mask=keep)


def add_lora_delta(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """y [T, N] += lora_delta(x [T, K], a [S, R, K], b [S, N, R], slots [T]), in place; returns y. `b` may
    be any strided view (the engine holds it as [S, R, N])."""
    tokens, k = x.shape
    r, n = a.shape[1], b.shape[1]
    x = x.contiguous()
    a = a.contiguous()
    assert y.stride(1) == 1 and tokens == y.shape[0]
    if tokens == 0:
        return y
    block_r = triton.next_power_of_2(max(r, 1))
    shrunk = torch.empty((tokens, r), dtype=torch.float32, device=x.device)
    _shrink[(tokens,)](
        x, a, slots, shrunk, k, r, x.stride(0), a.stride(0), a.stride(1), BLOCK_R=block_r, BLOCK_K=BLOCK_K
    )
    _expand[(tokens, triton.cdiv(n, BLOCK_N))](
        shrunk, b, slots, y, n, r, y.stride(0), b.stride(0), b.stride(1), b.stride(2), BLOCK_R=block_r, BLOCK_N=BLOCK_N
    )
    return y
