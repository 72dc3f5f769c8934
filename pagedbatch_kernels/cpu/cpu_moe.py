"""The routed experts of a step of few tokens through the native kernel (`csrc/cpu_moe.cpp`): each chosen
expert's weights read once for all of its rows, the experts no token chose not read, in one call.

`engine.models.moe.padded_experts` (every expert through two bmm over a zero-padded batch) reads all the
experts' weights at every decode step, and `grouped_experts` pays a dozen dispatches per expert; on a
decode step of the bench's Qwen3-MoE both cost more than the arithmetic.

The kernel reads the weights block-packed (`pack_experts`, once at the first call in
`engine.models.moe.Experts`, in place of the plain tensors): each matrix [N, K] as [N / T][K][T], T the
library's tile of outputs (`tile_outs`: 32 with AVX-512, 16 with AVX2) and N padded with zero rows, so a
register tile streams contiguous memory instead of T floats at a stride of N per input."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedbatch_kernels.cpu import cpu_native
from pagedbatch_kernels.cpu.cpu_prefill import onednn_bf16, padded_rows

DTYPES = (torch.float32, torch.bfloat16)
# bfloat16 steps of at least this many tokens go through oneDNN's GEMMs where the CPU has AMX tiles (the
# bench's Qwen3-MoE on a 2-core Xeon, a layer: 4,100 tokens 16 ms against the kernel's 74, 2,000: 11 against
# 34, 1,000: 8 against 17; at 512 rows of fixed shape 4.8 against 6.7, at 256 4.1 against 3.4)
GEMM_TOKENS = 384


def takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the native kernel is here and takes these tensors (CPU, float32 or bfloat16 weights)."""
    return (
        x.device.type == "cpu"
        and gate_up.dtype in DTYPES
        and down.dtype == gate_up.dtype
        and x.dtype in DTYPES
        and cpu_native.library() is not None
    )


def tile_outs() -> int:
    """The outputs of one block of the packed layout, as the library was built (its vector width)."""
    return cpu_native.library().pb_moe_tile_outs()


def _pack(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """[..., N, K] as [..., ceil(N / tile), K, tile], the rows past N zero."""
    *lead, n, k = weight.shape
    blocks = -(-n // tile)
    if blocks * tile != n:
        weight = torch.cat([weight, weight.new_zeros(*lead, blocks * tile - n, k)], dim=-2)
    return weight.reshape(*lead, blocks, tile, k).transpose(-1, -2).contiguous()


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    *lead, blocks, k, tile = packed.shape
    return packed.transpose(-1, -2).reshape(*lead, blocks * tile, k)[..., :n, :].contiguous()


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] (gate rows first) and down [E, H, I] as the kernel reads them: gate_up
    [E, 2, I / T, H, T] (the gate then the up matrix, packed) and down [E, H / T, I, T]."""
    experts, double, hidden = gate_up.shape
    tile = tile_outs()
    return _pack(gate_up.reshape(experts, 2, double // 2, hidden), tile), _pack(down, tile)


def unpack_experts(gate_up: torch.Tensor, down: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_experts` undone: the plain contiguous gate_up [E, 2I, H] and down [E, H, I]."""
    inter = down.shape[2]
    plain = _unpack(gate_up, inter)
    return plain.reshape(plain.shape[0], 2 * inter, plain.shape[-1]), _unpack(down, hidden)


def moe_packed(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`moe_experts` over weights that `pack_experts` packed."""
    tokens, hidden = x.shape
    experts, inter = down.shape[0], down.shape[2]
    assert gate_up.shape[:2] == (experts, 2) and gate_up.shape[3] == hidden and gate_up.is_contiguous()
    assert down.is_contiguous() and gate_up.shape[-1] == down.shape[-1] == tile_outs()
    rows = x.to(torch.float32).contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty((tokens, hidden), dtype=torch.float32)
    status = cpu_native.library().pb_moe_experts(
        rows.data_ptr(),
        tokens,
        hidden,
        gate_up.data_ptr(),
        down.data_ptr(),
        inter,
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


def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`engine.models.moe.grouped_experts` with SiLU-and-multiply and no biases: x [T, H], gate_up
    [E, 2I, H] (gate rows first), down [E, H, I], weights [T, k] and ids [T, k] of the router; [T, H] in
    x's dtype. For tensors that `takes` takes; packs the weights at every call (the engine packs once)."""
    return moe_packed(x, *pack_experts(gate_up, down), weights, ids)


@functools.cache
def _amx() -> bool:
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check()) and onednn_bf16()


def prefers_gemm(x: torch.Tensor) -> bool:
    """Whether a step's experts run faster through oneDNN's GEMMs (`moe_gemm`) than through the kernel: a
    bfloat16 step of GEMM_TOKENS tokens or more on a CPU with AMX, whose tiles multiply bfloat16 several times
    faster than the kernel, which widens them to float32 for AVX-512 FMAs. Elsewhere the kernel stays: in
    float32 the GEMMs were no faster at 1,024 tokens and ~15 % faster at 4,096 on that Xeon, slower below; on the
    AMD EPYC (no AMX) the kernel was the fastest path at every size measured (1..4,096 tokens)."""
    return x.dtype == torch.bfloat16 and x.shape[0] >= GEMM_TOKENS and _amx()


def moe_gemm(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`moe_packed` through torch's GEMMs: the (token, choice) pairs grouped by expert, each chosen expert's
    matrices unpacked (a copy of that expert's alone, never of all of them) and multiplied by its rows."""
    tokens, hidden = x.shape
    experts, inter = down.shape[0], down.shape[2]
    flat = ids.reshape(-1).to(torch.int64)
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < experts:
        raise IndexError("an expert id past the experts")
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    rows = order // ids.shape[1]
    scales = weights.reshape(-1).to(torch.float32)[order].unsqueeze(1)
    picked = x[rows]
    out = torch.zeros((tokens, hidden), dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        mine = F.pad(picked[start:end], (0, 0, 0, padded_rows(count) - count))
        gate, up = F.linear(mine, _unpack(gate_up[expert], inter).flatten(0, 1)).split(inter, dim=1)
        done = F.linear(F.silu(gate) * up, _unpack(down[expert], hidden))[:count]
        out.index_add_(0, rows[start:end], done.to(torch.float32) * scales[start:end])
        start = end
    return out.to(x.dtype)
