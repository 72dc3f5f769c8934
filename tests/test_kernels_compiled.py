"""The CPU engine's compiled kernels (`kernels.compiled`, `kernels.cpu_attention`) against their
plain-torch twins in `kernels.reference` on random inputs of many shapes, and the eager fallback
where compiling fails."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels import compiled, cpu_attention, reference
from tests.test_kernels_reference import make_batch, naive

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("shape", [
    ([1], [0]),  # one sequence, one token: the batch and the table are padded to two
    ([1, 1], [15, 16]),  # a context of exactly one block, and one past it
    ([1] * 9, [3, 70, 15, 33, 200, 48, 1, 16, 17]),  # a pure decode step of mixed lengths
    ([1, 1, 40, 9, 1, 23], [70, 15, 0, 48, 16, 17]),  # decodes among prefills and prefix chunks
], ids=["single", "block-edges", "decodes", "mixed"])
def test_paged_attention_equals_naive(shape, heads, dtype):
    q_lens, ctx_lens = shape
    batch = make_batch(q_lens, ctx_lens, *heads, dtype)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive(**batch), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (48, 8), (64, 32), (128, 16)])
def test_decode_kernel_equals_the_reference_decode(head_dim, block_size):
    q_lens, ctx_lens = [1] * 5, [5, 90, 31, 32, 64]
    batch = make_batch(q_lens, ctx_lens, 8, 2, torch.float32, head_dim=head_dim, block_size=block_size, seed=3)
    expected = reference.paged_attention(**batch)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 37])
def test_pointwise_kernels_equal_the_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(compiled.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tol)
    got, expected = compiled.fused_add_rms_norm(x, residual, weight, 1e-5), reference.fused_add_rms_norm(
        x, residual, weight, 1e-5)
    torch.testing.assert_close(got, expected, **tol)
    gate_up = torch.randn(rows, 2 * 64, generator=gen).to(dtype)
    torch.testing.assert_close(compiled.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tol)
    q, k = torch.randn(rows, 4, 32, generator=gen).to(dtype), torch.randn(rows, 2, 32, generator=gen).to(dtype)
    positions = torch.randint(0, 100, (rows,), generator=gen)
    cos_sin = torch.randn(100, 32, generator=gen)
    for got, expected in zip(compiled.apply_rotary(q, k, positions, cos_sin),
                             reference.apply_rotary(q, k, positions, cos_sin)):
        torch.testing.assert_close(got, expected, **tol)


def test_a_kernel_that_fails_to_compile_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    kernel = compiled.Compiled(reference.silu_and_mul)
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="kernels.compiled"):
        assert torch.equal(kernel(x), reference.silu_and_mul(x))
    assert kernel.failed and "no C++ compiler" in caplog.text
    assert torch.equal(kernel(x), reference.silu_and_mul(x))  # and no second attempt


def test_the_decode_kernel_falls_back_to_the_reference_decode(monkeypatch):
    kernel = compiled.Compiled(cpu_attention.decode_attention, fallback=cpu_attention._reference_decode)
    kernel.failed = True
    monkeypatch.setattr(cpu_attention, "_kernel", kernel)
    batch = make_batch([1, 1, 1], [40, 3, 17], 6, 2, torch.float32)
    torch.testing.assert_close(cpu_attention.paged_attention(**batch).double(), naive(**batch), atol=1e-5, rtol=1e-5)
