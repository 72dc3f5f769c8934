"""RMSNorm and fused residual-add + RMSNorm: one program per row, statistics in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D [rows, last_dim] tensor with a unit last stride (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first, exactly as `x + residual` in torch does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = _rows(x)
    dtype = x.dtype if residual is None else torch.result_type(x, residual)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        res2 = _rows(residual)
        res_out = torch.empty(x.shape, dtype=dtype, device=x.device)
        res_out2 = res_out.view(-1, hidden)
    else:  # unused by the kernel
        res2, res_out, res_out2 = x2, None, x2
    rows = x2.shape[0]
    if rows == 0:
        return out, res_out
    block = max(triton.next_power_of_2(hidden), 16)
    _rms_norm_kernel[(rows,)](
        x2,
        res2,
        weight,
        out2,
        res_out2,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        res_out2.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors, in one pass over memory."""
    return _launch(x, residual, weight, eps)
