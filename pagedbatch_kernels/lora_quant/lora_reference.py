"""The plain-torch twin of the batched LoRA delta (`pagedbatch_kernels.lora_quant.lora`): every row multiplied
by its own slot's stacked adapter weights, slot 0 holding zeros (rows of the base model)."""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K]; a [S, R, K]; b [S, N, R]; slots [T] -> [T, N]: (x[t] @ a[slots[t]].T) @ b[slots[t]].T,
    accumulated in float32 and returned in x's dtype."""
    shrunk = torch.einsum("tk,trk->tr", x.float(), a.float()[slots.long()])
    return torch.einsum("tr,tnr->tn", shrunk, b.float()[slots.long()]).to(x.dtype)
