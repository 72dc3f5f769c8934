"""Checkpoint tensors of one quantized linear layer, converted to the layout the engine keeps
(pagedbatch_kernels.lora_quant.quant_matmul: [N, ...] uint8 codes, two 4-bit codes a byte, low nibble first;
float8_e4m3fn weights; [N, G] scales and zero-point codes; g_idx).

Source layouts: compressed-tensors packs codes + 2^(bits-1) little-endian into int32 along the input
dimension (zero points along the output one); GPTQ packs `qweight` along the input dimension and
`qzeros` along the output one, v1 storing zero - 1; AWQ packs both along the output dimension in the
order 0 2 4 6 1 3 5 7; FP8 block scales cover `block_rows` x `group_size` weights."""

from __future__ import annotations

import torch

from engine.quant.config import QuantConfig, Scheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
FP8_MAX = 448.0


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C] -> [..., 2C] 4-bit codes, low nibble first."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2C] codes in 0..15 -> uint8 [..., C], the even column in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def int32_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 4W], little-endian (the byte order every packer wrote)."""
    return words.contiguous().view(torch.uint8)


def _along_outputs(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 [R, N*bits/32] packed along the output dimension -> [N, R] codes."""
    codes = int32_bytes(words)
    if bits == 4:
        codes = nibbles(codes)
        if order is not None:  # AWQ: undo the interleaving within each word of eight
            codes = codes.view(codes.shape[0], -1, 8)[..., torch.tensor(order).argsort()].flatten(1)
    return codes.t().contiguous()


def _along_inputs(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight int32 [K*bits/32, N] -> our [N, K/2 or K] uint8 layout."""
    return int32_bytes(words.t())


def convert(qc: QuantConfig, scheme: Scheme, suffix: str, tensor: torch.Tensor, rows: int) -> list | None:
    """[(part, tensor)] for the engine's buffers from one checkpoint tensor of a layer (`rows` output
    features); [] for a tensor with nothing to keep; None for one the layer does not own (bias)."""
    if suffix == "bias":
        return None
    if qc.method == "compressed-tensors":
        return _compressed_tensors(scheme, suffix, tensor, rows)
    if qc.method == "fp8":
        return _fp8_online(tensor) if qc.fmt == "online" else _fp8(scheme, suffix, tensor, rows, "weight_scale_inv")
    if qc.method == "awq":
        return _awq(suffix, tensor)
    return _gptq(qc, scheme, suffix, tensor)


def _compressed_tensors(scheme: Scheme, suffix: str, tensor: torch.Tensor, rows: int) -> list:
    if scheme.fp8:
        return _fp8(scheme, suffix, tensor, rows, "weight_scale")
    offset = 1 << (scheme.bits - 1)
    if suffix == "weight_packed":
        return [("qweight", int32_bytes(tensor))]
    if suffix == "weight" and tensor.dtype == torch.int8:  # naive-quantized 8-bit: signed codes
        return [("qweight", (tensor.to(torch.int16) + offset).to(torch.uint8))]
    if suffix == "weight_scale":
        return [("scales", tensor.reshape(rows, -1))]
    if suffix == "weight_zero_point":
        if tensor.dtype == torch.int32:  # packed along the output dimension
            return [("zeros", _along_outputs(tensor.t(), scheme.bits)[:rows].contiguous())]
        return [("zeros", (tensor.reshape(rows, -1).to(torch.int16) + offset).to(torch.uint8))]
    if suffix == "weight_g_idx":
        return [("g_idx", tensor.to(torch.int32))]
    if suffix == "weight_shape":
        return []
    raise ValueError(f"unexpected compressed-tensors tensor {suffix!r}")


def _fp8(scheme: Scheme, suffix: str, tensor: torch.Tensor, rows: int, scale_name: str) -> list:
    if suffix == "weight":
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8 weight stored as {tensor.dtype}, expected float8_e4m3fn")
        return [("qweight", tensor)]
    if suffix == scale_name:
        if scheme.block_rows:  # one scale per block: every row of a block gets its block's scales
            return [("scales", tensor.float().repeat_interleave(scheme.block_rows, dim=0)[:rows])]
        return [
            (
                "scales",
                tensor.float().reshape(-1, 1).expand(rows, 1)
                if tensor.numel() == 1
                else tensor.float().reshape(rows, 1),
            )
        ]
    if suffix in ("input_scale", "weight_zero_point"):
        if suffix == "input_scale":
            raise ValueError("static FP8 activation scales (input_scale) are not supported")
        return []
    raise ValueError(f"unexpected FP8 checkpoint tensor {suffix!r}")


def _fp8_online(tensor: torch.Tensor) -> list:
    """A dense weight quantized at load: one scale per output channel, its largest magnitude / 448."""
    w = tensor.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return [("qweight", (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)), ("scales", scale)]


def _awq(suffix: str, tensor: torch.Tensor) -> list:
    if suffix == "qweight":  # [K, N/8] -> codes [N, K] -> two a byte
        return [("qweight", pack_nibbles(_along_outputs(tensor, 4, AWQ_ORDER)))]
    if suffix == "qzeros":
        return [("zeros", _along_outputs(tensor, 4, AWQ_ORDER).to(torch.uint8))]
    if suffix == "scales":
        return [("scales", tensor.t())]
    raise ValueError(f"unexpected AWQ tensor {suffix!r}")


def _gptq(qc: QuantConfig, scheme: Scheme, suffix: str, tensor: torch.Tensor) -> list:
    if suffix == "qweight":
        return [("qweight", _along_inputs(tensor, scheme.bits))]
    if suffix == "qzeros":
        zeros = _along_outputs(tensor, scheme.bits).to(torch.int16)
        if qc.fmt == "gptq":  # v1 stores zero - 1
            zeros = (zeros + 1) & ((1 << scheme.bits) - 1)
        return [("zeros", zeros.to(torch.uint8))]
    if suffix == "scales":
        return [("scales", tensor.t())]
    if suffix == "g_idx":
        return [("g_idx", tensor.to(torch.int32))]
    raise ValueError(f"unexpected GPTQ tensor {suffix!r}")
