"""The Triton GEMM on quantized weights (W4A16, W8A16, FP8 weights): `x @ dequant(W).T (+ bias)` with
the weight dequantized tile by tile in registers, never whole. The layout and the plain-torch twin are
in `quant_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_e4m3_value(b):
    """float8_e4m3fn bits (int32) as float32, decoded arithmetically (any device, the interpreter too)."""
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = (b & 0x7).to(tl.float32)
    normal = (1.0 + mant / 8.0) * tl.exp2((exp - 7).to(tl.float32))
    subnormal = mant * 0.001953125  # mant * 2**-9
    return sign * tl.where(exp == 0, subnormal, normal)


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        wmask = mask_k[:, None] & mask_n[None, :]
        if BITS == 4:
            byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] // 2, mask=wmask, other=0)
            q = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 15
        else:
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0).to(tl.int32)
        if HAS_GIDX:
            group = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
        else:
            group = offs_k // group_size
        scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + group[:, None], mask=wmask, other=0.0)
        if FP8:
            w = _fp8_e4m3_value(q) * scale.to(tl.float32)
        else:
            if HAS_ZEROS:
                zero = tl.load(z_ptr + offs_n[None, :] * stride_zn + group[:, None], mask=wmask, other=0).to(tl.int32)
            else:
                zero = 1 << (BITS - 1)
            w = (q - zero).to(tl.float32) * scale.to(tl.float32)
        # 16-bit activations multiply as TF32 (more mantissa than bfloat16's): the interpreter has no
        # bfloat16 dot, so the kernel it checks is the one the GPU runs
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def quant_matmul(
    x,
    qweight,
    scales,
    zeros,
    bits: int,
    group_size: int,
    g_idx=None,
    bias=None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 32,
):
    """The Triton kernel: `x @ dequant(W).T (+ bias)` without materializing the weight."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*shape[:-1], n)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    w = qweight.view(torch.uint8) if fp8 else qweight
    block_m = block_m or min(64, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    dummy = scales
    _quant_matmul_kernel[grid](
        x2,
        w,
        scales,
        dummy if zeros is None else zeros,
        dummy if g_idx is None else g_idx,
        dummy if bias is None else bias,
        out,
        m,
        n,
        k,
        group_size,
        x2.stride(0),
        w.stride(0),
        scales.stride(0),
        0 if zeros is None else zeros.stride(0),
        out.stride(0),
        BITS=8 if fp8 else bits,
        FP8=fp8,
        HAS_ZEROS=zeros is not None,
        HAS_GIDX=g_idx is not None,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*shape[:-1], n)
