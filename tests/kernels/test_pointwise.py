"""Triton KV-cache write, RMSNorm, fused add + RMSNorm, rotary and SiLU-and-mul vs their torch twins."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Triton's CPU interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: on CPU a rounded
# bf16 result may be one ulp (2**-7 relative) off torch's; on the GPU it must be exact.
INTERPRETED = not CUDA


def assert_rounded_equal(got, expected):
    if INTERPRETED and got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    else:
        assert torch.equal(got, expected)


triton_ops = pytest.importorskip("pagedbatch_kernels.triton_ops")


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def assert_close(got, expected, dtype):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err < TOL[dtype], f"max rel err {err:.3g}"


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size",
    [(1, 1, 16, 16), (17, 2, 64, 16), (40, 8, 128, 32), (33, 3, 48, 32)],
)
def test_write_kv_cache(num_tokens, num_kv_heads, head_dim, block_size, cache_dtype):
    num_blocks = 6
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    slots = slots.to(DEVICE)
    # key/value as views of a fused projection, in fp32 even when the cache is bf16
    kv = randn(num_tokens, 2, num_kv_heads, head_dim, seed=1)
    key, value = kv[:, 0], kv[:, 1]
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, seed=2)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, seed=3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert triton_ops.write_kv_cache(key, value, k_cache, v_cache, slots) is None
    assert_rounded_equal(k_cache, k_ref)
    assert_rounded_equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 64), (3, 5, 100), (4, 4096)])
def test_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1) * 3
    weight = randn(shape[-1], dtype=dtype, seed=2)
    assert_close(triton_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (9, 64), (2, 3, 96), (5, 2048)])
def test_fused_add_rms_norm(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1)
    residual = randn(*shape, dtype=dtype, seed=2) * 4
    weight = randn(shape[-1], dtype=dtype, seed=3)
    x_before, res_before = x.clone(), residual.clone()
    normed, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_close(normed, ref_normed, dtype)
    assert_rounded_equal(new_residual, ref_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim",
    [(1, 1, 1, 16), (5, 4, 2, 32), (19, 8, 1, 64), (7, 16, 8, 128), (3, 6, 2, 80)],
)
def test_apply_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    max_pos = 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(DEVICE)
    # query and key as views of one fused QKV projection
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=1)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    before = qkv.clone()
    q, k = triton_ops.apply_rotary(query, key, positions, cos_sin)
    q_ref, k_ref = reference.apply_rotary(query, key, positions, cos_sin)
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (6, 200), (2, 3, 128), (3, 2 * 1536)])
def test_silu_and_mul(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1) * 2
    assert_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("fn", ["rms_norm", "silu_and_mul"])
def test_empty_batch(fn):
    x = torch.empty(0, 64, device=DEVICE)
    out = (
        triton_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6)
        if fn == "rms_norm"
        else (triton_ops.silu_and_mul(x))
    )
    assert out.shape[0] == 0
