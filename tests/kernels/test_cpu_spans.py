"""The native span kernel (`pagedbatch_kernels.cpu.cpu_native.span_attention`, `csrc/cpu_spans.cpp`): many rows
over one block table each, against a float64 twin on random pools of many shapes, for causal prompt
chunks, groups of one length, empty rows and contexts that end anywhere in a chunk of positions; its
bounds checks; the portable build; and the engine's prompt and chunk paths through it."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels.cpu import cpu_attention, cpu_native, cpu_prefill, cpu_prefix
from tests.kernels.test_cpu_native import SHAPES
from tests.kernels.test_reference import make_batch, naive

TOL = 3e-6  # float32 sums of values exact in either pool dtype


def random_spans(heads, kv_heads, head_dim, block_size, dtype, spans, seed=0, gap=0):
    """`spans`: (rows, kind) with kind "causal" (a prompt chunk after some context), "group" (every row
    the same length) or "random" (lengths 0..the table); `gap` rows between spans belong to none."""
    gen = torch.Generator().manual_seed(seed)
    width = max(rows for rows, _ in spans) // block_size + 6
    num_blocks = len(spans) * width + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    bounds, lengths, row = [], [], 0
    for rows, kind in spans:
        bounds.append([row, row + rows])
        if kind == "causal":
            before = int(torch.randint(0, width * block_size - rows + 1, (1,), generator=gen))
            lengths += [before + j + 1 for j in range(rows)]
        elif kind == "group":
            lengths += [int(torch.randint(1, width * block_size + 1, (1,), generator=gen))] * rows
        else:
            lengths += torch.randint(0, width * block_size + 1, (rows,), generator=gen).tolist()
        lengths += [0] * gap
        row += rows + gap
    return dict(
        query=torch.randn(row, heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        tables=torch.randperm(num_blocks, generator=gen)[: len(spans) * width].view(-1, width).int(),
        bounds=torch.tensor(bounds, dtype=torch.int32),
        lengths=torch.tensor(lengths, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def twin(query, k_cache, v_cache, tables, bounds, lengths, scale):
    """Row by row in float64: (output, log-sum-exp) of the spans' rows; others zero and -inf."""
    rows, heads, _ = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for s, (begin, end) in enumerate(bounds.tolist()):
        for r in range(begin, end):
            length = int(lengths[r])
            if length == 0:
                continue
            slots = [tables[s, p // block_size].item() * block_size + p % block_size for p in range(length)]
            k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
            v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[r].double(), k) * scale
            lse[r] = torch.logsumexp(scores, -1)
            out[r] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
    return out, lse


def span_rows(bounds) -> list[int]:
    return [r for begin, end in bounds.tolist() for r in range(begin, end)]


def assert_matches_twin(call, lib=None, tol=TOL):
    """Scores (the log-sum-exp) to float32 rounding; outputs too, or, where bfloat16 pools go through
    dot products of bfloat16 pairs, to the weights' rounding: each weight within 2**-9 of itself, so an
    output within 2**-9 of the largest value (2**-8 allowed)."""
    out, lse = cpu_native.span_attention(**call, lib=lib)
    assert out.dtype == lse.dtype == torch.float32
    want_out, want_lse = twin(**call)
    rows = span_rows(call["bounds"])
    out_tol = tol
    if call["v_cache"].dtype == torch.bfloat16 and cpu_native.span_rounds_bf16_weights(lib):
        out_tol = 2**-8 * call["v_cache"].abs().max().item()
    torch.testing.assert_close(out[rows].double(), want_out[rows], atol=out_tol, rtol=tol)
    torch.testing.assert_close(lse[rows].double(), want_lse[rows], atol=tol, rtol=tol)


MIX = [(1, "random"), (37, "causal"), (3, "group"), (70, "random"), (130, "causal"), (32, "group")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_equals_the_float64_twin(shape, dtype):
    assert_matches_twin(random_spans(*shape, dtype, MIX, seed=sum(shape)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def test_the_portable_build_equals_the_twin(shape, dtype, baseline_library):
    assert_matches_twin(random_spans(*shape, dtype, MIX[:4], seed=3), lib=baseline_library)


def test_rows_between_spans_are_left_alone():
    call = random_spans(6, 2, 64, 16, torch.float32, [(5, "causal"), (9, "group")], seed=4, gap=3)
    assert span_rows(call["bounds"]) == [*range(5), *range(8, 17)]
    assert_matches_twin(call)


def test_an_empty_row_gives_zeros_and_no_weight():
    call = random_spans(6, 2, 64, 16, torch.float32, [(4, "group")], seed=2)
    call["lengths"][1] = 0
    out, lse = cpu_native.span_attention(**call)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert_matches_twin(call)


def test_large_scores_rescale_without_overflow():
    call = random_spans(4, 2, 64, 16, torch.float32, [(50, "causal"), (20, "group")], seed=5)
    call["query"] *= 40  # scores in the thousands, the running maximum growing chunk after chunk
    assert_matches_twin(call, tol=1e-4)


def test_spans_past_the_rows_or_the_pool_are_refused_not_read():
    call = random_spans(6, 2, 64, 16, torch.float32, [(5, "causal"), (9, "group")], seed=1)
    with pytest.raises(IndexError):
        cpu_native.span_attention(**{**call, "bounds": torch.tensor([[0, 5], [5, 15]], dtype=torch.int32)})
    with pytest.raises(IndexError):
        cpu_native.span_attention(**{**call, "bounds": torch.tensor([[0, 5], [6, 5]], dtype=torch.int32)})
    too_long = call["lengths"].clone()
    too_long[7] = call["tables"].shape[1] * 16 + 1
    with pytest.raises(IndexError):
        cpu_native.span_attention(**{**call, "lengths": too_long})
    tables = call["tables"].clone()
    tables[1, 0] = call["k_cache"].shape[0]  # one past the pool
    with pytest.raises(IndexError):
        cpu_native.span_attention(**{**call, "tables": tables})


def test_head_sizes_and_groups_it_was_not_built_for_are_refused():
    call = random_spans(4, 2, 40, 16, torch.float32, [(3, "group")], seed=6)
    with pytest.raises(ValueError, match="head size 40"):
        cpu_native.span_attention(**call)
    assert not cpu_native.takes(torch.float32, 4, 2, 40) and not cpu_native.takes(torch.float32, 5, 2, 64)
    assert not cpu_native.takes(torch.float16, 4, 2, 64) and cpu_native.takes(torch.bfloat16, 4, 2, 64)


def test_runs_on_torchs_threads():
    call = random_spans(6, 2, 64, 16, torch.bfloat16, MIX, seed=8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_native.span_attention(**call)
        torch.set_num_threads(2)
        two = cpu_native.span_attention(**call)
    finally:
        torch.set_num_threads(before)
    rows = span_rows(call["bounds"])
    assert all(torch.equal(a[rows], b[rows]) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_through_the_native_kernel_equal_naive(dtype, monkeypatch):
    monkeypatch.setenv(cpu_prefill.CHOICE_ENV, "native")
    calls = []
    real = cpu_native.span_attention
    monkeypatch.setattr(cpu_native, "span_attention", lambda *a: calls.append(a[4].tolist()) or real(*a))
    # long prompts whole and after a cached prefix, beside decodes
    batch = make_batch([1, 100, 3, 70, 300], [30, 0, 20, 33, 0], 6, 2, dtype, seed=5)
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(
        got.double(),
        naive(**batch),
        atol=3e-2 if dtype == torch.bfloat16 else 1e-5,
        rtol=3e-2 if dtype == torch.bfloat16 else 1e-5,
    )
    assert [[1, 101], [104, 174], [174, 474]] in calls  # the three long prompts, each a span, in one call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_through_the_native_kernel_equal_naive(dtype, monkeypatch):
    monkeypatch.setenv(cpu_prefix.CHOICE_ENV, "native")
    # decodes and chunks after cached contexts, some sharing a system prompt of one block
    batch = make_batch([1, 5, 1, 40, 2, 64, 1, 17], [70, 16, 3, 200, 33, 9, 15, 48], 6, 2, dtype, seed=7)
    tables = batch["block_tables"].clone()
    tables[[1, 3, 4, 7], :1] = tables[0, :1]
    batch = {**batch, "block_tables": tables}
    plan = cpu_attention.plan_decodes(
        batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16, (6, 2), native_chunks=True
    )
    spanned = [call for call in plan.calls if call.spans is not None]
    assert spanned and not any(call.chunks for call in plan.calls)
    assert sorted(n for call in spanned for n in call.spans.bounds.diff().flatten().tolist()) == [2, 5, 17, 40, 64]
    got = cpu_attention.paged_attention(**batch)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), naive(**batch), atol=tol, rtol=tol)


def test_bfloat16_pools_use_the_cpus_bfloat16_dot_products_where_it_has_them(baseline_library):
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has = " avx512_bf16" in flags and " avx512bw" in flags
    assert cpu_native.span_rounds_bf16_weights() == has
    assert not cpu_native.span_rounds_bf16_weights(baseline_library)  # the portable build: float32 products
