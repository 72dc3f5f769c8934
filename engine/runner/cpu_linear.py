"""Linear layers on the CPU through oneDNN, with each weight reordered once at load.

PyTorch's float32 `F.linear` on the CPU is MKL's GEMM, which on AMD EPYC ran at ~220 GFLOP/s on
this model's shapes where oneDNN's kernels on a pre-packed weight ran at ~530 (`bench/cpu_linear.py`
measures it). bfloat16 already goes through oneDNN, but reorders the weight at every call.
The packed results are also batch invariant (a row's output does not depend on its batch), which
MKL's are not.

oneDNN builds a primitive for every input shape it meets (0.3-0.7 ms here, more than the whole call
on a decode step's few rows) and caches it. A step's row count varies from step to step, so calls
are padded to one of a few sizes (`padded_rows`: eight per doubling, at most 1/8 extra rows) and the
engine builds the primitives of the smaller ones at load (`warm_packed_linears`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch_kernels.cpu.cpu_prefill import onednn_bf16, padded_rows

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks the packed layout for about this many rows; any count runs
WARM_ROWS = 512  # above this, building a primitive costs little beside running it


def row_sizes(max_rows: int) -> list[int]:
    """Every size `padded_rows` gives for 1..max_rows rows."""
    return sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of its weight (the plain one is dropped). Where
    oneDNN has no bfloat16 kernels on this CPU (AVX2 only), a bfloat16 weight is packed as float32 and
    the rows multiplied in float32, then rounded to bfloat16: what a bfloat16 GEMM, which accumulates
    in float32, computes, ~7x faster there than torch's bfloat16 fallback, for twice the weight's memory."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        compute = torch.float32 if weight.dtype == torch.bfloat16 and not onednn_bf16() else weight.dtype
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight.to(compute), BATCH_HINT), persistent=False
        )
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, "none", "")

    def forward_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """`F.gelu(self(x), approximate=approximate)` with the GELU fused into the GEMM (a oneDNN post-op)."""
        return self._run(x, None, "gelu", approximate)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)` with the sum fused into the GEMM."""
        return self._run(x, residual, "add", "")

    def _run(self, x, other, attr: str, algorithm: str) -> torch.Tensor:
        # each step down a small model's decode calls this a few hundred times: nothing is done that the
        # call does not need (no reshape of 2-D rows, no cast to the same dtype, no slice without padding)
        compute = self.packed.dtype
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype != compute:
            rows = rows.to(compute)
        count = rows.shape[0]
        padded = padded_rows(count)
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        if other is None:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, attr, [], algorithm)
        else:
            other = other.reshape(-1, self.out_features)
            if other.dtype != compute:
                other = other.to(compute)
            if padded != count:
                other = F.pad(other, (0, 0, 0, padded - count))
            out = torch.ops.mkldnn._linear_pointwise.binary(rows, other.contiguous(), self.packed, self.bias, attr)
        if padded != count:
            out = out[:count]
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def warm_packed_linears(model: nn.Module, max_rows: int) -> int:
    """Build oneDNN's primitives for every padded size up to min(max_rows, WARM_ROWS), once per
    distinct layer shape (modules of one shape share them); returns how many calls that took."""
    shapes = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            key = (module.in_features, module.out_features, module.dtype, module.bias is None)
            shapes.setdefault(key, module)
    sizes = row_sizes(min(max_rows, WARM_ROWS))
    for module in shapes.values():
        for rows in sizes:
            module(torch.zeros(rows, module.in_features, dtype=module.dtype, device=module.packed.device))
    return len(shapes) * len(sizes)


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many. A weight tied to
    another module (the LM head to the embedding) is packed as a copy; the other keeps the original."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
