"""The fused MoE Triton kernel (through the interpreter on CPU) against its plain-torch twin, and the
twin against per-token arithmetic; the device-side grouping's invariants."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedbatch_kernels.moe_align import align
from pagedbatch_kernels.moe_align import fused_moe as twin

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(tokens, experts=6, hidden=40, inter=24, k=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(DEVICE, dtype)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return x, gate_up, down, weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 4, 2), (5, 6, 3), (37, 8, 2), (20, 3, 1)])
def test_align_groups_every_row_once_by_expert(tokens, experts, k):
    _, _, _, _, ids = _case(tokens, experts=experts, k=k)
    row_ids, block_experts = align(ids, experts, 4)
    assert row_ids.numel() == block_experts.numel() * 4
    real = row_ids[row_ids < tokens * k]
    assert sorted(real.tolist()) == list(range(tokens * k))
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_experts.tolist()):
        block = row_ids[b * 4 : (b + 1) * 4]
        block = block[block < tokens * k]
        if expert >= experts:
            assert block.numel() == 0
        else:
            assert (flat[block.long()] == expert).all()


@pytest.mark.parametrize("tokens", [0, 1, 9, 33])
def test_twin_equals_per_token_sum(tokens):
    x, gate_up, down, weights, ids = _case(tokens, dtype=torch.float64)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want[t] += weights[t, j].double() * (down[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(twin(x, gate_up, down, weights, ids), want, rtol=1e-5, atol=1e-5)  # float32 inside


triton_moe = pytest.importorskip("pagedbatch_kernels.fused_moe")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,k", [(0, 4, 2), (1, 4, 2), (7, 6, 3), (40, 8, 2)])
def test_triton_fused_moe_matches_twin(tokens, experts, k, dtype):
    x, gate_up, down, weights, ids = _case(tokens, experts=experts, k=k, dtype=dtype, seed=tokens)
    got = triton_moe.fused_moe(x, gate_up, down, weights, ids)
    want = twin(x, gate_up, down, weights, ids, block=triton_moe.BLOCK_M)
    assert got.shape == want.shape and got.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
