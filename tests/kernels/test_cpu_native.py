"""The native CPU decode kernel (`pagedbatch_kernels.cpu.cpu_native`, `pagedbatch_kernels/csrc/cpu_decode.cpp`)
against its plain-torch twin in float64 on random pools of many shapes, built for this CPU and for the compiler's
baseline target (no AVX: the portable reductions); its bounds checks, its build cache, and the
engine falling back to inductor's kernel where it cannot be built or is turned off."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from pagedbatch_kernels.cpu import cpu_decode, cpu_native
from tests.helpers import REPO

SHAPES = [  # heads, KV heads, head size, block size
    (6, 2, 64, 16),
    (4, 4, 32, 16),
    (8, 1, 128, 16),
    (32, 4, 128, 32),
    (4, 1, 80, 16),
    (14, 2, 64, 8),
    (16, 1, 256, 16),
    (12, 12, 96, 16),
    (40, 8, 128, 16),
    (20, 2, 160, 16),
    (4, 2, 16, 16),  # the tiny test models' head size
]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6}  # the pool's values are exact in both: float32 sums


def random_call(heads, kv_heads, head_dim, block_size, dtype, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lengths) // block_size)) + 1  # a spare column, as the engine's tables have
    num_blocks = len(lengths) * width + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return dict(
        query=torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=torch.randperm(num_blocks, generator=gen)[: len(lengths) * width].view(-1, width).int(),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def twin(query, k_cache, v_cache, block_tables, seq_lens, scale):
    """Row by row in float64: (output, log-sum-exp of the scaled scores)."""
    rows, heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for r, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        slots = [block_tables[r, p // block_size].item() * block_size + p % block_size for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[r].double(), k) * scale
        lse[r] = torch.logsumexp(scores, -1)
        out[r] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
    return out, lse


def assert_matches_twin(call, lib=None, tol=None):
    out, lse = cpu_native.decode_attention(**call, lib=lib)
    assert out.dtype == lse.dtype == torch.float32
    want_out, want_lse = twin(**call)
    tol = tol or TOL[call["k_cache"].dtype]
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_the_kernel_builds_here():
    assert cpu_native.library() is not None, "a C++ compiler is part of this project's setup (inductor needs one)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_equals_the_float64_twin(shape, dtype):
    # lengths: one token, a block exactly, a block and one, long, and everything between
    lengths = [1, shape[3], shape[3] + 1, 333, 2, 17, 3 * shape[3] - 1]
    assert_matches_twin(random_call(*shape, dtype, lengths, seed=sum(shape)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_the_portable_build_equals_the_twin(shape, dtype, baseline_library):
    assert_matches_twin(random_call(*shape, dtype, [1, 40, 129, 7], seed=3), lib=baseline_library)


def test_random_lengths_and_row_counts():
    gen = torch.Generator().manual_seed(11)
    for trial in range(12):
        rows = int(torch.randint(1, 40, (1,), generator=gen))
        lengths = torch.randint(1, 600, (rows,), generator=gen).tolist()
        dtype = (torch.float32, torch.bfloat16)[trial % 2]
        assert_matches_twin(random_call(6, 2, 64, 16, dtype, lengths, seed=trial))


def test_large_scores_do_not_overflow():
    call = random_call(4, 2, 64, 16, torch.float32, [50, 300], seed=5)
    call["query"] *= 40  # scores in the thousands: the softmax must subtract its maximum
    assert_matches_twin(call, tol=1e-4)  # a float32 score of ~1,000 is exact to ~1e-4


def test_an_empty_row_gives_zeros_and_no_weight():
    call = random_call(6, 2, 64, 16, torch.float32, [0, 20], seed=2)
    out, lse = cpu_native.decode_attention(**call)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    merged = cpu_decode.merge_partial(out, lse, torch.ones_like(out), torch.zeros_like(lse))
    assert torch.equal(merged[0], torch.ones_like(out[0]))  # the empty part weighs nothing in a merge


@pytest.mark.parametrize("rows,heads,head_dim", [(5, 6, 64), (300, 8, 128), (3, 2, 80), (2, 4, 20)])
def test_the_native_merge_equals_torchs(rows, heads, head_dim):
    gen = torch.Generator().manual_seed(rows)
    out_a, out_b = torch.randn(rows, heads, head_dim, generator=gen), torch.randn(rows, heads, head_dim, generator=gen)
    lse_a, lse_b = torch.randn(rows, heads, generator=gen) * 5, torch.randn(rows, heads, generator=gen) * 5
    lse_a[0, 0] = -torch.inf  # an empty part weighs nothing
    want_out = cpu_decode.merge_partial(out_a, lse_a, out_b, lse_b)
    want_lse = torch.logaddexp(lse_a, lse_b)
    got_out, got_lse = cpu_native.merge_partial(out_a.clone(), lse_a.clone(), out_b, lse_b)
    torch.testing.assert_close(got_out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_out[0, 0], out_b[0, 0])
    assert cpu_native.merge_partial(out_a.double(), lse_a, out_b, lse_b) is None  # not float32: torch merges


def test_a_context_past_its_table_or_the_pool_is_refused_not_read():
    call = random_call(6, 2, 64, 16, torch.float32, [20, 30], seed=1)
    too_long = {**call, "seq_lens": torch.tensor([20, 30 + 16 * 3], dtype=torch.int32)}
    with pytest.raises(IndexError):
        cpu_native.decode_attention(**too_long)
    tables = call["block_tables"].clone()
    tables[1, 0] = call["k_cache"].shape[0]  # one past the pool
    with pytest.raises(IndexError):
        cpu_native.decode_attention(**{**call, "block_tables": tables})
    tables[1, 0] = -1
    with pytest.raises(IndexError):
        cpu_native.decode_attention(**{**call, "block_tables": tables})


def test_head_sizes_it_was_not_built_for_go_to_inductors_kernel(monkeypatch):
    call = random_call(4, 2, 40, 16, torch.float32, [5, 70], seed=4)  # 40: not a multiple of 16
    assert not cpu_native.supports(call["query"], call["k_cache"])
    seen = []
    reference = cpu_decode._reference_decode
    monkeypatch.setattr(cpu_decode, "_decode", lambda *args: seen.append(1) or reference(*args))
    out, _ = cpu_decode.decode_kernel(*call.values())
    assert seen and torch.allclose(out.double(), twin(**call)[0], atol=1e-5)


def test_a_float16_pool_goes_to_inductors_kernel():
    call = random_call(4, 2, 64, 16, torch.float16, [5, 70], seed=4)
    assert not cpu_native.supports(call["query"], call["k_cache"])


def test_the_build_is_cached_by_source_flags_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = [*cpu_native.FLAGS, "-DPB_CACHE_TEST"]
    first = cpu_native.build(flags)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(flags) == first and first.stat().st_mtime_ns == mtime  # not built again
    assert cpu_native.build([*flags, "-DPB_OTHER"]) != first
    assert [p.name for p in first.parent.iterdir() if p.name.endswith(".partial")] == []


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native.build([*cpu_native.FLAGS, "-fno-such-flag-anywhere"])
    assert list((tmp_path / "pagedbatch" / "native").iterdir()) == []  # no partial file left behind
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_native.build()


def test_without_a_compiler_the_engine_warns_and_keeps_inductors_kernel(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_native, "_loaded", False)
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    with caplog.at_level(logging.WARNING, logger="pagedbatch_kernels.cpu.cpu_native"):
        assert cpu_native.library() is None
    assert "no C++ compiler" in caplog.text
    call = random_call(6, 2, 64, 16, torch.float32, [9, 40], seed=6)
    assert not cpu_native.supports(call["query"], call["k_cache"])
    out, _ = cpu_decode.decode_kernel(*call.values())
    torch.testing.assert_close(out.double(), twin(**call)[0], atol=1e-5, rtol=1e-5)


def test_turned_off_by_the_environment():
    code = "from pagedbatch_kernels.cpu import cpu_native; print(cpu_native.library() is None)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, cpu_native.ENV: "off"},
    )
    assert done.stdout.strip() == "True"


def test_runs_on_torchs_threads(monkeypatch):
    """Two threads or one, the same result: the kernel's OpenMP loop splits the rows, not the sums."""
    call = random_call(6, 2, 64, 16, torch.bfloat16, list(range(1, 200, 7)), seed=8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.decode_attention(**call)
        torch.set_num_threads(2)
        two = cpu_native.decode_attention(**call)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
