"""A linear layer whose weight stays quantized in memory: FP8, or 4/8-bit integer codes with group
scales (pagedbatch_kernels.lora_quant.quant_reference's layout). With the Triton kernel set (CUDA) its GEMM
multiplies without a dense weight; otherwise the weight is dequantized per matmul, a block of output
rows at a time (FP8 on the CPU by the native kernels' one-pass decoder), and the dense block dropped.
Fused layers (QKV, gate/up) hold their checkpoint shards one after another in the output rows."""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.config import Scheme
from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.lora_quant.quant_reference import (
    ROW_BLOCK_BYTES,
    fp8_per_token_codes,
    quant_matmul_torch,
    quantize_fp8_per_token,
)


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: Scheme,
        dtype: torch.dtype,
        device: torch.device,
        kernel=None,
    ):
        super().__init__()
        self.kernel = kernel or quant_matmul_torch  # the kernel set's quantized GEMM, else the torch twin
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.bits = 8 if scheme.fp8 else scheme.bits
        self.group_size = scheme.group_size or in_features
        if in_features % (2 if self.bits == 4 else 1):
            raise ValueError(f"4-bit weights need an even input size, got {in_features}")
        groups = -(-in_features // self.group_size)
        n, k = out_features, in_features
        if scheme.fp8:
            qweight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
        else:
            qweight = torch.empty(n, k // 2 if self.bits == 4 else k, dtype=torch.uint8, device=device)
        self.register_buffer("qweight", qweight)
        # scales in the model's dtype (float32 keeps the checkpoint's exactly); integer zero-point codes
        self.register_buffer("scales", torch.empty(n, groups, dtype=dtype, device=device))
        has_zeros = not scheme.fp8 and not scheme.symmetric
        self.register_buffer("zeros", torch.empty(n, groups, dtype=torch.uint8, device=device) if has_zeros else None)
        self.register_buffer("g_idx", None)
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.loaded: dict[str, int] = {}  # part -> rows loaded
        self._g_idx_seen = None

    def load_rows(self, part: str, tensor: torch.Tensor, start: int, rows: int) -> None:
        """Write one checkpoint shard's `part` into output rows start..start+rows (g_idx: the whole)."""
        with torch.no_grad():
            if part == "g_idx":  # one input order for every shard: GPTQ orders by the shared input's statistics
                if tensor.shape != (self.in_features,):
                    raise ValueError(f"g_idx has shape {tuple(tensor.shape)}, expected ({self.in_features},)")
                if self._g_idx_seen is not None and not torch.equal(self._g_idx_seen, tensor.int()):
                    raise ValueError("the shards of one fused layer have different g_idx")
                self._g_idx_seen = tensor.int()
                trivial = torch.equal(tensor.long(), torch.arange(self.in_features) // self.group_size)
                self.g_idx = None if trivial else tensor.to(self.qweight.device, torch.int32)
                return
            target = getattr(self, part)
            if target is None:
                raise ValueError(f"a symmetric {self.scheme} layer has no {part}")
            dst = target.narrow(0, start, rows)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"quantized {part} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype) if tensor.dtype != dst.dtype else tensor)
        self.loaded[part] = self.loaded.get(part, 0) + rows

    def pack_for_cpu(self) -> bool:
        """With 16-bit activations on the CPU, 4-bit weights go to PyTorch's int4 CPU GEMM
        (`_weight_int4pack_mm_for_cpu`: its own nibble order, [G, N, 2] scales and float zeros, the
        same bytes per weight), ~4x faster than dequantizing every call. Returns whether it did."""
        w = self.qweight
        if (
            w.device.type != "cpu"
            or self.kernel is not quant_matmul_torch
            or self.bits != 4
            or self.scheme.fp8
            or self.g_idx is not None
            or self.scales.dtype not in (torch.bfloat16, torch.float16)
            or self.in_features % self.group_size
            or not hasattr(torch, "_weight_int4pack_mm_for_cpu")
        ):
            return False
        codes = torch.stack((w & 15, w >> 4), dim=-1).flatten(-2).int()
        zeros = self.zeros.float() if self.zeros is not None else torch.full_like(self.scales, 8, dtype=torch.float32)
        scales = self.scales.float()
        try:
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        except RuntimeError:  # a shape the CPU kernel does not take: stay on the twin
            return False
        # its weights are (code - 8) * scale + zero: our (code - z) * scale has zero = (8 - z) * scale
        self.register_buffer(
            "scale_zeros",
            torch.stack((scales, (8 - zeros) * scales), -1).transpose(0, 1).contiguous().to(self.scales.dtype),
        )
        self.register_buffer("int4pack", packed)
        self.qweight = self.scales = self.zeros = None
        return True

    def missing(self) -> list[str]:
        wanted = ["qweight", "scales"] + (["zeros"] if self.zeros is not None else [])
        return [part for part in wanted if self.loaded.get(part, 0) != self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.act_dynamic:
            x = self._dynamic_fp8(x)
        if self.qweight is None:  # packed for PyTorch's int4 CPU GEMM
            rows = x.reshape(-1, self.in_features).contiguous()
            out = torch._weight_int4pack_mm_for_cpu(rows, self.int4pack, self.group_size, self.scale_zeros)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if (
            self.scheme.fp8
            and self.kernel is quant_matmul_torch
            and self.g_idx is None
            and x.dtype == self.scales.dtype
        ):
            out = self._fp8_native(x)
            if out is not None:
                return out
        return self.kernel(x, self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.g_idx, self.bias)

    def _dynamic_fp8(self, x: torch.Tensor) -> torch.Tensor:
        """`quantize_fp8_per_token(x, act_group)`; on the CPU its codes decoded and scaled in one pass by
        `cpu_native.dequantize_fp8` (the same float32 product, bit for bit), as the FP8 weights are."""
        if x.device.type == "cpu":
            q, scale = fp8_per_token_codes(x, self.scheme.act_group)
            deq = cpu_native.dequantize_fp8(q, scale)
            if deq is not None:
                return deq.view(x.shape).to(x.dtype)
        return quantize_fp8_per_token(x, self.scheme.act_group)

    def _fp8_native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The twin's result, each block of output rows dequantized by `cpu_native.dequantize_fp8`; None
        where that kernel does not take the weight."""
        n, k = self.qweight.shape
        rows = max(1, min(n, ROW_BLOCK_BYTES // max(1, k * x.element_size())))
        outs = []
        for start in range(0, n, rows):
            end = min(n, start + rows)
            w = cpu_native.dequantize_fp8(self.qweight[start:end], self.scales[start:end])
            if w is None:
                return None
            outs.append(torch.nn.functional.linear(x, w, None if self.bias is None else self.bias[start:end]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def extra_repr(self) -> str:
        s = self.scheme
        kind = "fp8" if s.fp8 else f"int{s.bits}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {kind}, "
            f"group_size={self.group_size}, act_fp8={s.act_dynamic}"
        )
