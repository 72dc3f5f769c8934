"""SiLU-and-mul: out = silu(x[..., :d]) * x[..., d:], computed in fp32."""

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
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    out2 = out.view(-1, d)
    if x2.shape[0] == 0 or d == 0:
        return out
    block = min(max(triton.next_power_of_2(d), 16), 1024)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4
    )
    return out
