"""The routed experts of a step of few tokens through the native kernel (`csrc/cpu_moe.cpp`): each chosen
expert's weights read once for all of its rows, the experts no token chose not read, in one call.

`engine.models.moe.padded_experts` (every expert through two bmm over a zero-padded batch) reads all the
experts' weights at every decode step, and `grouped_experts` pays a dozen dispatches per expert; on a
decode step of the bench's Qwen3-MoE both cost more than the arithmetic."""

from __future__ import annotations

import torch

from pagedbatch_kernels.cpu import cpu_native

DTYPES = (torch.float32, torch.bfloat16)


def takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the native kernel is here and takes these tensors (CPU, float32 or bfloat16 weights)."""
    return (
        x.device.type == "cpu"
        and gate_up.dtype in DTYPES
        and down.dtype == gate_up.dtype
        and x.dtype in DTYPES
        and cpu_native.library() is not None
    )


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`engine.models.moe.grouped_experts` with SiLU-and-multiply and no biases: x [T, H], gate_up
    [E, 2I, H] (gate rows first), down [E, H, I], weights [T, k] and ids [T, k] of the router; [T, H] in
    x's dtype. For tensors that `takes` takes."""
    tokens, hidden = x.shape
    experts, double, _ = gate_up.shape
    assert down.shape == (experts, hidden, double // 2)
    rows = x.to(torch.float32).contiguous()
    # the kernel reads the weights transposed; free where they are laid out so (`cpu_layout`)
    gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty((tokens, hidden), dtype=torch.float32)
    status = cpu_native.library().pb_moe_experts(
        rows.data_ptr(),
        tokens,
        hidden,
        gate_up.data_ptr(),
        down.data_ptr(),
        double // 2,
        experts,
        ids.data_ptr(),
        weights.data_ptr(),
        ids.shape[1],
        out.data_ptr(),
        int(gate_up.dtype == torch.bfloat16),
    )
    if status != 0:
        raise IndexError("an expert id past the experts")
    return out.to(x.dtype)


def cpu_layout(weight: torch.nn.Parameter) -> None:
    """Lay an expert weight [E, out, in] out as the kernel reads it (in place, same shape and values):
    strides (out * in, 1, out), each input's outputs contiguous. torch's matmuls take either layout."""
    if not weight.transpose(1, 2).is_contiguous():
        weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
