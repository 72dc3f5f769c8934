"""The fused mixture-of-experts kernel: the experts' SwiGLU MLPs for a whole step in two grouped GEMM
launches (gate/up, then down weighted by the router), on the rows `moe_align.align` grouped by
expert. No host read anywhere, so a CUDA graph can hold it. `moe_align.fused_moe` is its twin."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbatch_kernels.activation import silu_and_mul
from pagedbatch_kernels.moe_align import align

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _expert_gemm(
    a_ptr,
    w_ptr,
    out_ptr,
    row_ids_ptr,
    block_experts_ptr,
    weights_ptr,
    num_rows,
    num_experts,
    a_row_div,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    MUL_WEIGHTS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row] = a[row // a_row_div] @ w[expert].T (times weights[row]) for the rows of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    rows = tl.load(row_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows  # padding slots hold the sentinel num_rows (a block past the last expert's: all)
    a_rows = tl.where(valid, rows // a_row_div, 0).to(tl.int64)
    w_base = w_ptr + tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_we
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _gemm(a, w, out, row_ids, block_experts, weights, a_row_div: int, mul_weights: bool) -> None:
    num_experts, n, k = w.shape
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _expert_gemm[grid](
        a,
        w,
        out,
        row_ids,
        block_experts,
        weights,
        out.shape[0],
        num_experts,
        a_row_div,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        MUL_WEIGHTS=mul_weights,
        IEEE=a.dtype == torch.float32,
        UPCAST=not a.is_cuda and a.dtype != torch.float32,  # the interpreter has no bf16 dot
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H] in x's dtype (see `moe_align.fused_moe`)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    rows = tokens * top_k
    x = x.contiguous()
    row_ids, block_experts = align(ids, gate_up.shape[0], BLOCK_M)
    h = torch.empty(rows, gate_up.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, row_ids, block_experts, h, top_k, mul_weights=False)
    act = silu_and_mul(h)
    out = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    _gemm(act, down, out, row_ids, block_experts, flat_weights, 1, mul_weights=True)
    return out.view(tokens, top_k, hidden).sum(1).to(x.dtype)
