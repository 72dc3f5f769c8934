"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's hub experts: each group of 32 weights along the
input dimension is 16 bytes of E2M1 codes (two a byte, the low nibble first) and one E8M0 scale byte
(a power of two, biased by 127). The engine dequantises these experts at load (`dequantize_mxfp4`);
`pack_mxfp4` writes them (the tiny-model writer's MXFP4 variant)."""

from __future__ import annotations

import torch

GROUP = 32  # weights per scale
# E2M1's sixteen codes: sign bit, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> weights [..., G * 32] in `dtype`, one
    leading slice (an expert) at a time so that the codes' index tensor stays small."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lead = blocks.shape[:-2]
    blocks, scales = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(blocks.shape[0], blocks.shape[1] * GROUP, dtype=dtype, device=blocks.device)
    for i in range(blocks.shape[0]):
        codes = torch.stack((blocks[i] & 0x0F, blocks[i] >> 4), dim=-1).long()  # [G, 16, 2]
        values = lut[codes].flatten(-2)  # [G, 32]
        exponents = scales[i].to(torch.int32).sub(SCALE_BIAS).unsqueeze(-1)
        out[i] = torch.ldexp(values, exponents).flatten().to(dtype)
    return out.reshape(*lead, -1)


def pack_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `weights` [..., N] (N a multiple of 32): each group's scale is the power of
    two that brings its largest magnitude to at most 6, each weight the nearest E2M1 value."""
    if weights.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 packs groups of {GROUP} weights; the last dimension is {weights.shape[-1]}")
    groups = weights.float().reshape(*weights.shape[:-1], -1, GROUP)
    peak = groups.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-120)
    exponents = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = torch.ldexp(groups, -exponents.to(torch.int32))
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)  # nearest magnitude
    codes = (codes + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponents.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
