"""The native per-token kernels (`pagedbatch_kernels.cpu.cpu_pointwise`, `csrc/cpu_pointwise.cpp`) against
`pagedbatch_kernels.reference`: bit for bit where the arithmetic is the same element by element (rotary, the
cache write), to the rounding of the dtype where a sum's order differs (norms) or the exp is our own (SiLU); the
layouts and dtypes they hand back to the reference; refused positions and slots."""

from __future__ import annotations

import pytest
import torch

from engine.models.rotary import cos_sin_cache
from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_native, cpu_pointwise

DTYPES = [torch.float32, torch.bfloat16]


def rows(count, size, dtype, seed):
    return (torch.randn(count, size, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (48, 384), (7, 100), (3, 2, 64), (300, 384)])  # 300: threads share rows
def test_norms_equal_the_reference(dtype, shape):
    x, residual = rows(shape[0], int(torch.tensor(shape[1:]).prod()), dtype, 1), rows(shape[0], 1, dtype, 2)
    x, residual = x.view(shape), (x * 0.5 + residual).view(shape)
    weight = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    # float32 sums of squares in another order than torch's: float32 rounding, or in bfloat16 now and
    # then one bfloat16 ulp where the result lies by a rounding boundary (1 of 115,200 at 300 rows)
    tol = dict(atol=0, rtol=2**-7) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(cpu_pointwise.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol)
    out, total = cpu_pointwise.fused_add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_total = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)  # the residual sum rounds as torch's add
    torch.testing.assert_close(out, want_out, **tol)


def qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the model splits them out of its fused projection: strided views."""
    qkv = rows(tokens, (heads + 2 * kv_heads) * head_dim, dtype, seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.reshape(tokens, heads, head_dim),
        k.reshape(tokens, kv_heads, head_dim),
        v.reshape(tokens, kv_heads, head_dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2, 64), (4, 4, 32), (8, 1, 128), (2, 1, 80)])
@pytest.mark.parametrize("tokens", [33, 200])  # 200: threads share the tokens
def test_rotary_equals_the_reference_bit_for_bit(dtype, heads, tokens):
    q, k, _ = qkv_views(tokens, *heads, dtype)
    table = cos_sin_cache(heads[2], 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(4))
    got, want = cpu_pointwise.apply_rotary(q, k, positions, table), reference.apply_rotary(q, k, positions, table)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("shape", [(1, 2 * 1024), (40, 2 * 1024), (5, 2 * 37), (2, 3, 2 * 24)])
def test_silu_and_mul_is_within_float32_rounding_of_torch(shape):
    x = rows(shape[0], int(torch.tensor(shape[1:]).prod()), torch.float32, 6).view(shape) * 4
    x.view(-1)[:8] = torch.tensor([-100.0, -88.0, -87.5, 0.0, 88.0, 89.0, 100.0, float("nan")])
    got, want = cpu_pointwise.silu_and_mul(x), reference.silu_and_mul(x)
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    # the exp is our own, within ~1 ulp of torch's: the quotient within a few float32 ulps
    torch.testing.assert_close(got, want, atol=1e-30, rtol=5e-7, equal_nan=True)


def test_silu_and_mul_leaves_bfloat16_to_torch(monkeypatch):
    calls = []
    real = reference.silu_and_mul
    monkeypatch.setattr(reference, "silu_and_mul", lambda x: calls.append(x.dtype) or real(x))
    x = rows(4, 64, torch.bfloat16, 7)
    assert torch.equal(cpu_pointwise.silu_and_mul(x), real(x)) and calls == [torch.bfloat16]
    cpu_pointwise.silu_and_mul(x.float())
    assert calls == [torch.bfloat16]  # float32 went native


def test_a_position_past_the_rotary_table_is_refused():
    q, k, _ = qkv_views(3, 6, 2, 64, torch.float32)
    table = cos_sin_cache(64, 100, 10000.0, None)
    with pytest.raises(IndexError):
        cpu_pointwise.apply_rotary(q, k, torch.tensor([0, 100, 5]), table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cache_write_equals_the_reference_and_skips_padding(dtype):
    q, k, v = qkv_views(20, 6, 2, 64, dtype)
    slots = torch.randperm(10 * 16, generator=torch.Generator().manual_seed(5))[:20]
    slots[[3, 11]] = -1  # padding rows
    caches = [torch.zeros(10, 16, 2, 64, dtype=dtype) for _ in range(4)]
    cpu_pointwise.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(IndexError):
        cpu_pointwise.write_kv_cache(k, v, caches[0], caches[1], torch.full((20,), 160))
    assert torch.equal(caches[0], caches[2])  # refused whole, nothing written


def test_what_the_kernels_do_not_take_goes_to_the_reference(monkeypatch):
    calls = []
    for name in ("rms_norm", "apply_rotary", "write_kv_cache"):
        real = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    x = rows(4, 64, torch.float16, 1)
    cpu_pointwise.rms_norm(x, torch.ones(64, dtype=torch.float16), 1e-6)  # float16
    strided = rows(4, 64, torch.float32, 1).t()  # not contiguous: copied, then the native kernel
    got = cpu_pointwise.rms_norm(strided, torch.ones(4), 1e-6)
    assert calls == ["rms_norm"]
    torch.testing.assert_close(got, reference.rms_norm(strided, torch.ones(4), 1e-6), atol=2e-6, rtol=2e-6)
    q, k, v = qkv_views(5, 6, 2, 64, torch.float32)
    cpu_pointwise.apply_rotary(
        q.transpose(0, 1).contiguous().transpose(0, 1), k, torch.arange(5), cos_sin_cache(64, 16, 10000.0, None)
    )  # heads apart
    cpu_pointwise.write_kv_cache(
        k,
        v,
        torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16),
        torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16),
        torch.arange(5),
    )  # cache dtype
    assert calls == ["rms_norm", "rms_norm", "apply_rotary", "write_kv_cache"]  # the second: the check above
    monkeypatch.setattr(cpu_native, "library", lambda: None)  # no compiler
    cpu_pointwise.rms_norm(rows(4, 64, torch.float32, 1), torch.ones(64), 1e-6)
    assert calls[-1] == "rms_norm" and len(calls) == 5
