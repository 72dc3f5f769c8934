"""QuantLinear on its own: 4-bit layers with 16-bit activations move to PyTorch's int4 CPU GEMM."""

from __future__ import annotations

import pytest
import torch

from engine.quant.config import Scheme
from engine.quant.linear import QuantLinear


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_cpu_gemm_matches_the_twin(symmetric, dtype):
    """16-bit activations on the CPU: 4-bit layers move to PyTorch's int4 GEMM after loading, with the
    same output as dequantizing (up to 16-bit rounding) and no more bytes."""
    gen = torch.Generator().manual_seed(0)
    n, k, group = 96, 256, 32
    layer = QuantLinear(k, n, True, Scheme(False, 4, group_size=group, symmetric=symmetric), dtype, torch.device("cpu"))
    layer.load_rows("qweight", torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8), 0, n)
    layer.load_rows("scales", torch.rand(n, k // group, generator=gen) * 0.02, 0, n)
    if not symmetric:
        layer.load_rows("zeros", torch.randint(0, 16, (n, k // group), generator=gen).to(torch.uint8), 0, n)
    layer.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(3, 5, k, generator=gen).to(dtype)
    want = layer(x)
    before = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.scales))
    assert layer.pack_for_cpu() and layer.qweight is None
    got = layer(x)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert layer.int4pack.numel() * layer.int4pack.element_size() == n * k // 2
    assert layer.int4pack.numel() + layer.scale_zeros.numel() * 2 <= 2 * before
