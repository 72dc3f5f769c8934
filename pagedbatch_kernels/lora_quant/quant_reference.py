"""Matmuls on quantized weights (W4A16, W8A16, FP8 weights), `out = x @ dequant(W).T`, in plain torch.

The weight layout every quantized format is converted to at load (engine.quant.formats):
- `qweight` [N, K] uint8 codes (8-bit integers), [N, K/2] uint8 with two 4-bit codes per byte (column
  2j in the low nibble, 2j+1 in the high one), or [N, K] float8_e4m3fn (FP8);
- `scales` [N, G] with G groups of `group_size` consecutive inputs (G=1: one scale per output channel);
- `zeros` [N, G] uint8 codes, or None: symmetric, the middle code (8 or 128; FP8 has none);
- `g_idx` [K] int32 or None: input k's group, when groups are not consecutive (GPTQ's act-order).
A weight is (code - zero) * scale. `dequantize` and `quant_matmul_torch` are the plain-torch twins of
the Triton kernel (`quant_matmul`); the CPU engine uses the twin, one block of output rows at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_BLOCK_BYTES = 32 << 20  # the CPU twin dequantizes at most this much weight at once


def fp8_to_float(qweight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn as float32 by bit arithmetic, exactly what `.float()` gives (NaN included): PyTorch's
    own CPU conversion runs element by element, ~100x slower. The 7 magnitude bits go to the top of a
    float32's exponent and mantissa, which reads as the value times 2**-120 (a subnormal float32 for an
    FP8 subnormal, so no special case): one multiplication by 2**120 restores it."""
    b = qweight.view(torch.uint8).to(torch.int32)
    magnitude = b & 0x7F
    value = (((b & 0x80) << 24) | (magnitude << 20)).view(torch.float32) * 2.0**120
    return value.masked_fill_(magnitude == 0x7F, float("nan"))


def codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The [N, K] codes of a packed weight (uint8 for integers, float32 for FP8)."""
    if qweight.dtype == torch.float8_e4m3fn:
        return fp8_to_float(qweight) if qweight.device.type == "cpu" else qweight.float()
    if bits != 4:
        return qweight
    out = torch.empty(qweight.shape[0], qweight.shape[1] * 2, dtype=torch.uint8, device=qweight.device)
    out[:, 0::2] = qweight & 15
    out[:, 1::2] = qweight >> 4
    return out


def dequantize(qweight, scales, zeros, bits: int, group_size: int, g_idx=None, dtype=None) -> torch.Tensor:
    """The [N, K] weight in `dtype` (default the scales' dtype), computed in the scales' dtype."""
    q = codes(qweight, bits)
    n, k = q.shape
    fp8 = qweight.dtype == torch.float8_e4m3fn
    if g_idx is not None:  # groups by index: gather each input's scale and zero point
        group = g_idx.long()
        zero = zeros[:, group].to(scales.dtype) if zeros is not None else (0 if fp8 else 1 << (bits - 1))
        w = (q.to(scales.dtype) - zero) * scales[:, group]
        return w.to(dtype or scales.dtype)
    groups = scales.shape[1]
    if k % groups:  # a last, shorter group (FP8 blocks over an odd width): pad, then cut
        pad = groups * group_size - k
        q = torch.nn.functional.pad(q, (0, pad))
    grouped = q.view(n, groups, -1).to(scales.dtype)
    if zeros is not None:
        grouped = grouped - zeros.to(scales.dtype).unsqueeze(-1)
    elif not fp8:
        grouped = grouped - (1 << (bits - 1))
    w = (grouped * scales.unsqueeze(-1)).view(n, -1)[:, :k]
    return w.to(dtype or scales.dtype)


def quant_matmul_torch(x, qweight, scales, zeros, bits: int, group_size: int, g_idx=None, bias=None):
    """`x @ dequant(W).T (+ bias)`, dequantizing blocks of output rows of at most ROW_BLOCK_BYTES."""
    n = qweight.shape[0]
    k = x.shape[-1]
    rows = max(1, min(n, ROW_BLOCK_BYTES // max(1, k * x.element_size())))
    outs = []
    for start in range(0, n, rows):
        end = min(n, start + rows)
        w = dequantize(
            qweight[start:end],
            scales[start:end],
            None if zeros is None else zeros[start:end],
            bits,
            group_size,
            g_idx,
            x.dtype,
        )
        outs.append(F.linear(x, w, None if bias is None else bias[start:end]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def fp8_per_token_codes(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 activations: x [..., K] as rows [T, K] of float8_e4m3fn codes and their float32 scales
    [T, G] (G = K / `group_size`, 1 without): each token's (or each group of `group_size` inputs') scale
    is its largest magnitude / 448; x / scale rounds to float8_e4m3fn."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    k = x.shape[-1]
    xf = x.reshape(-1, k).float()
    xf = xf.view(xf.shape[0], -1, group_size or k)
    scale = xf.abs().amax(dim=-1, keepdim=True) / finfo.max
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    q = (xf / scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
    return q.view(-1, k), scale.view(q.shape[0], -1)


def quantize_fp8_per_token(x: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """Dynamic FP8 activations, dequantized again: `fp8_per_token_codes` times their scales, in x's dtype."""
    q, scale = fp8_per_token_codes(x, group_size)
    deq = codes(q, 8).view(q.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)
    return deq.reshape(x.shape).to(x.dtype)
