"""The CPU's LoRA layer: the base weight and every slot's A in one oneDNN-packed weight.

A LoRA layer on the CPU whose base is a plain float32/bfloat16 `nn.Linear` is not packed on its own
(`engine.runner.cpu_linear.PackedLinear`); `PackedCat` packs [W; A_1; ..; A_S] (A_s: slot s's stacked
ranks, [parts * R, in]) as one weight, and the slots' B as another. A step then costs two GEMMs per
layer whatever the mix of adapters:

    out = (x @ [W; A_1..A_S]^T) * [1 | mask]      the base output and every slot's ranks, each row
                                                   keeping only its own slot's (a oneDNN "mul" post-op)
    y   = out[:, S*R:] @ [B_1 .. B_S]^T + out[:, :N]   (a oneDNN "add" post-op)

against four calls for the base GEMM followed by the masked delta (shrink, mask, expand), each GEMM a
fork and join of the thread pool, which is what costs most on a few decode rows. A row of the base
model gets its base output exactly: its ranks are multiplied by 0, and adding 0 leaves it as it is.
The packed weights are rebuilt (from the plain weight, kept for this) at the first step after a slot
changes. The base output alone (a step without adapters) is the first GEMM without the mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.runner.cpu_linear import BATCH_HINT, WARM_ROWS, padded_rows, row_sizes
from pagedbatch_kernels.cpu.cpu_prefill import onednn_bf16


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)


class PackedCat(nn.Module):
    """The base layer of a CPU `LoRALinear`: `forward` is the base linear layer; `forward_lora` adds
    each row's own adapter's delta. `lora_a` [S + 1, width, in] and `lora_bt` [S + 1, width, out] are
    the LoRALinear's stacked adapter weights (slot 0 unused), read again by `rebuild`."""

    def __init__(self, linear: nn.Linear, lora_a: torch.Tensor, lora_bt: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.compute = torch.float32 if self.dtype == torch.bfloat16 and not onednn_bf16() else self.dtype
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.compute)
        self.lora_a, self.lora_bt = lora_a, lora_bt  # shared with the LoRALinear (not buffers here)
        self.ranks = (lora_a.shape[0] - 1) * lora_a.shape[1]  # S * width: the packed ranks after W
        self.cat: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.rebuild()

    @torch.no_grad()
    def rebuild(self) -> None:
        a = self.lora_a[1:].reshape(self.ranks, self.in_features)
        self.cat = _pack(torch.cat([self.weight, a.to(self.dtype)]).to(self.compute))
        self.b = _pack(self.lora_bt[1:].reshape(self.ranks, self.out_features).T.to(self.compute))
        self.stale = False

    def _rows(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        rows = x.reshape(-1, self.in_features).to(self.compute)
        count = rows.shape[0]
        padded = padded_rows(count)
        if padded != count:
            rows = F.pad(rows, (0, 0, 0, padded - count))
        return rows, count, padded

    def _finish(self, y: torch.Tensor, x: torch.Tensor, count: int) -> torch.Tensor:
        return y[:count].reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, count, _ = self._rows(x)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.cat, self.bias, "none", [], "")
        return self._finish(out[:, : self.out_features].contiguous(), x, count)

    def forward_lora(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`mask` [padded rows, out + S * width] (`StepMapping.packed_mask`): 1 on the base columns and on
        each row's own slot's ranks, 0 elsewhere."""
        if self.stale:
            self.rebuild()
        rows, count, padded = self._rows(x)
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, mask[:padded], self.cat, self.bias, "mul")
        n = self.out_features
        shrunk, base = out[:, n:].contiguous(), out[:, :n].contiguous()
        y = torch.ops.mkldnn._linear_pointwise.binary(shrunk, base, self.b, None, "add")
        return self._finish(y, x, count)

    @torch.no_grad()
    def warm(self, max_rows: int) -> None:
        """Build oneDNN's primitives of this layer's shapes for every padded size up to
        min(max_rows, WARM_ROWS) (what `cpu_linear.warm_packed_linears` does for the base layers)."""
        for rows in row_sizes(min(max_rows, WARM_ROWS)):
            x = torch.zeros(rows, self.in_features, dtype=self.dtype)
            self(x)
            self.forward_lora(x, torch.zeros(rows, self.out_features + self.ranks, dtype=self.compute))

    def warm_key(self) -> tuple:
        return (self.in_features, self.out_features, self.ranks, self.dtype, self.bias is None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora_ranks={self.ranks}"
