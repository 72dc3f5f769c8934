"""The quantized-weight Triton GEMM (through the interpreter on CPU) against its plain-torch twin, and the
twin against arithmetic on explicit codes; the dynamic FP8 activations against a quantize-dequantize
written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedbatch_kernels.lora_quant.quant_matmul import quant_matmul
from pagedbatch_kernels.lora_quant.quant_reference import dequantize, quant_matmul_torch, quantize_fp8_per_token

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _weight(kind, n, k, group, seed=0, act_order=False):
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.01
    zeros = g_idx = None
    if kind == "fp8":
        qweight = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
        bits = 8
    else:
        bits = 4 if kind.startswith("int4") else 8
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)
        qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8) if bits == 4 else codes.to(torch.uint8)
        if kind.endswith("zp"):
            zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen, dtype=torch.int32).to(torch.uint8)
    if act_order:
        g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32)
    return qweight, scales, zeros, bits, g_idx


def _codes_reference(qweight, scales, zeros, bits, group, g_idx):
    """Every weight from its own code, one loop over inputs: the layout written out plainly."""
    n, k = scales.shape[0], (qweight.shape[1] * 2 if bits == 4 and qweight.dtype == torch.uint8 else qweight.shape[1])
    w = torch.empty(n, k)
    for col in range(k):
        if qweight.dtype == torch.float8_e4m3fn:
            code = qweight[:, col].float()
        elif bits == 4:
            code = ((qweight[:, col // 2].int() >> (4 * (col % 2))) & 15).float()
        else:
            code = qweight[:, col].float()
        g = int(g_idx[col]) if g_idx is not None else col // group
        zero = (
            0.0
            if qweight.dtype == torch.float8_e4m3fn
            else (zeros[:, g].float() if zeros is not None else float(1 << (bits - 1)))
        )
        w[:, col] = (code - zero) * scales[:, g]
    return w


CASES = [
    ("int4", 64, 32, 32),
    ("int4zp", 96, 128, 32),
    ("int4", 72, 256, 64),
    ("int4zp", 40, 64, 16),
    ("int8", 64, 96, 32),
    ("int8zp", 33, 64, 64),
    ("fp8", 48, 64, 64),
    ("fp8", 80, 256, 128),
]


@pytest.mark.parametrize("kind,n,k,group", CASES)
def test_dequantize_matches_codes(kind, n, k, group):
    qweight, scales, zeros, bits, _ = _weight(kind, n, k, group)
    got = dequantize(qweight, scales, zeros, bits, group)
    torch.testing.assert_close(got, _codes_reference(qweight, scales, zeros, bits, group, None), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind,n,k,group", CASES)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_triton_matches_twin(kind, n, k, group, rows):
    qweight, scales, zeros, bits, _ = _weight(kind, n, k, group, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    args = [t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, zeros)]
    got = quant_matmul(*args, bits, group)
    want = quant_matmul_torch(*args, bits, group)
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["int4zp", "int4"])
def test_act_order_groups_and_bias(kind):
    """GPTQ's act-order: each input's group from g_idx; a bias is added after."""
    qweight, scales, zeros, bits, g_idx = _weight(kind, 48, 128, 32, act_order=True)
    bias = torch.randn(48)
    x = torch.randn(7, 128)
    want = F.linear(x, _codes_reference(qweight, scales, zeros, bits, 32, g_idx), bias)
    torch.testing.assert_close(
        quant_matmul_torch(x, qweight, scales, zeros, bits, 32, g_idx, bias), want, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        quant_matmul(x, qweight, scales, zeros, bits, 32, g_idx, bias), want, rtol=1e-4, atol=1e-4
    )


def test_twin_blocks_of_rows_match_one_block(monkeypatch):
    qweight, scales, zeros, bits, _ = _weight("int4zp", 96, 128, 32)
    x = torch.randn(9, 128)
    whole = quant_matmul_torch(x, qweight, scales, zeros, bits, 32)
    # 10 rows a block
    monkeypatch.setattr("pagedbatch_kernels.lora_quant.quant_reference.ROW_BLOCK_BYTES", 128 * 4 * 10)
    torch.testing.assert_close(quant_matmul_torch(x, qweight, scales, zeros, bits, 32), whole, rtol=1e-5, atol=1e-5)


def test_bfloat16_activations():
    qweight, scales, zeros, bits, _ = _weight("int4", 64, 128, 32)
    x = torch.randn(6, 128).to(torch.bfloat16)
    got = quant_matmul(x, qweight, scales.to(torch.bfloat16), zeros, bits, 32)
    want = F.linear(x.float(), dequantize(qweight, scales, zeros, bits, 32))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group", [None, 16])
def test_dynamic_fp8_activations(group):
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 5)[:, None]
    x[2] = 0.0  # an all-zero token keeps zeros
    got = quantize_fp8_per_token(x, group)
    for row in range(5):
        pieces = x[row].reshape(-1, group or 64)
        for i, piece in enumerate(pieces):
            scale = piece.abs().max() / 448.0
            want = piece if scale == 0 else (piece / scale).to(torch.float8_e4m3fn).float() * scale
            got_piece = got[row].reshape(-1, group or 64)[i]
            torch.testing.assert_close(got_piece, want, rtol=0, atol=0)
    assert (got - x).abs().max() > 0  # it really rounds


@pytest.mark.parametrize("group", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_fp8_activations_decoded_natively_equal_the_twin(group, dtype):
    """The CPU engine's path for dynamic FP8 activations (engine.quant.linear: the codes decoded and scaled
    by `cpu_native.dequantize_fp8`) equals `quantize_fp8_per_token` bit for bit."""
    from engine.quant.config import Scheme
    from engine.quant.linear import QuantLinear
    from pagedbatch_kernels.cpu import cpu_native

    if cpu_native.library() is None:
        pytest.skip("no native CPU kernels here")
    x = (torch.randn(3, 4, 64) * torch.logspace(-6, 3, 64)).to(dtype)
    x[1, 2] = 0.0
    layer = QuantLinear(64, 8, False, Scheme(True, 8, act_dynamic=True, act_group=group), dtype, torch.device("cpu"))
    got = layer._dynamic_fp8(x)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, quantize_fp8_per_token(x, group))


def _every_fp8_code() -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def test_fp8_decoded_by_bits_equals_torchs_conversion():
    from pagedbatch_kernels.lora_quant.quant_reference import fp8_to_float

    codes = _every_fp8_code()
    assert _same_bits(fp8_to_float(codes), codes.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 4])
def test_native_fp8_dequantize_equals_the_twin(dtype, groups):
    """Every FP8 code (subnormals, both zeros, NaN) times scales, as `dequantize` rounds it."""
    from pagedbatch_kernels.cpu import cpu_native

    codes = _every_fp8_code()
    scales = (torch.rand(16, groups, generator=torch.Generator().manual_seed(groups)) * 3).to(dtype)
    got = cpu_native.dequantize_fp8(codes, scales)
    assert got is not None, "the native kernels build on this machine"
    assert got.dtype == dtype
    assert _same_bits(got, dequantize(codes, scales, None, 8, 16 // groups, None, dtype))
