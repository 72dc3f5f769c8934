"""Linear layers on the CPU through oneDNN, with each weight reordered once at load.

PyTorch's float32 `F.linear` on the CPU is MKL's GEMM, which on AMD EPYC ran at ~220 GFLOP/s on
this model's shapes where oneDNN's kernels on a pre-packed weight ran at ~530 (`bench/cpu_linear.py`
measures it). bfloat16 already goes through oneDNN, but reorders the weight at every call.
The packed results are also batch invariant (a row's output does not depend on its batch), which
MKL's are not.
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 64  # oneDNN picks the packed layout for about this many rows; any count runs


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of its weight (the plain one is dropped)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many. A weight tied to
    another module (the LM head to the embedding) is packed as a copy; the other keeps the original."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
