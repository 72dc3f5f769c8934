"""Decodes' attention over the prefix blocks their group shares (`pagedbatch_kernels.cpu.cpu_prefix`): the batched
bfloat16 matmuls against the float64 softmax of every row over its group's prefix, how groups are
batched (padding and score bounds), and flash attention where a group is too large to batch."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels.cpu import cpu_native, cpu_prefix

BLOCK = 16


def make_groups(sizes, num_heads=6, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, seed=0):
    """Groups of (rows, prefix blocks), in row order, over one pool of random K/V."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(blocks for _, blocks in sizes) + 4
    shape = (num_blocks, BLOCK, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen)
    groups, row, used = [], 0, 0
    for rows, blocks in sizes:
        groups.append((row, row + rows, pool[used : used + blocks]))
        row, used = row + rows, used + blocks
    query = torch.randn(row, num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, groups


def naive(query, k_cache, v_cache, groups, scale):
    """Row by row in float64: the softmax over the group's prefix, and its log-sum-exp."""
    group_size = query.shape[1] // k_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    lse = torch.empty(query.shape[:2], dtype=torch.float64)
    for start, end, blocks in groups:
        keys = k_cache[blocks].flatten(0, 1).double().repeat_interleave(group_size, dim=1)  # [L, H, D]
        values = v_cache[blocks].flatten(0, 1).double().repeat_interleave(group_size, dim=1)
        for r in range(start, end):
            scores = torch.einsum("hd,lhd->hl", query[r].double(), keys) * scale
            lse[r] = torch.logsumexp(scores, dim=-1)
            out[r] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values)
    return out, lse


def check(query, k_cache, v_cache, groups, plan, tol, out_tol=None):
    scale = query.shape[2] ** -0.5
    out, lse = cpu_prefix.grouped_prefix_attention(query, k_cache, v_cache, groups, scale, plan)
    assert out.dtype == lse.dtype == torch.float32
    expected_out, expected_lse = naive(query, k_cache, v_cache, groups, scale)
    torch.testing.assert_close(out.double(), expected_out, atol=out_tol or tol, rtol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tol, rtol=tol)


SIZES = {
    "equal": [(4, 3), (4, 3), (4, 3)],  # one batch, nothing padded
    "unequal": [(3, 2), (1, 5), (7, 4), (2, 1), (5, 5)],  # rows and prefixes padded, some apart
    "single-row": [(1, 1)],
}


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_batched_bfloat16_groups_equal_the_naive_softmax(sizes, heads):
    query, k_cache, v_cache, groups = make_groups(sizes, *heads, seed=len(sizes))
    plan = cpu_prefix.plan_prefixes(groups, heads[0], heads[1], BLOCK)
    assert not plan.alone and sum(len(b.picks) for b in plan.batches) == query.shape[0]
    # no view: dynamo guards a view's base too, and a base of one group compiled the softmax again mid-run
    assert all(b.bias._base is None for b in plan.batches)
    check(query, k_cache, v_cache, groups, plan, 3e-2)


def test_float32_stays_exact_through_flash_attention_per_group():
    query, k_cache, v_cache, groups = make_groups(SIZES["unequal"], dtype=torch.float32)
    plan = cpu_prefix.plan_prefixes(groups, 6, 2, BLOCK)  # ignored: batched scores would be float32 matmuls
    check(query, k_cache, v_cache, groups, plan, 1e-5)


def test_batches_bound_their_padding_and_their_scores(monkeypatch):
    sizes = [(2, 1), (2, 1), (30, 1), (2, 8), (3, 8), (40, 40)]
    query, k_cache, v_cache, groups = make_groups(sizes, seed=3)
    monkeypatch.setattr(cpu_prefix, "SCORES_LIMIT", 40 * 6 * 40 * BLOCK - 1)  # the last group alone exceeds it
    plan = cpu_prefix.plan_prefixes(groups, 6, 2, BLOCK)
    assert plan.alone == [5]
    for batch in plan.batches:
        count, height = batch.rows.shape
        width = batch.blocks.shape[1]
        rows = set(batch.rows.flatten()[batch.picks].tolist())  # the real rows, padding left out
        members = [g for g in range(5) if set(range(*groups[g][:2])) <= rows]
        assert sum(sizes[g][0] for g in members) == len(rows)
        real = sum(sizes[g][0] * sizes[g][1] for g in members)
        assert count * height * width <= cpu_prefix.MAX_PADDING * real
        assert count * height * 6 * width * BLOCK <= cpu_prefix.SCORES_LIMIT
        # padded prefix positions are masked, and only those
        assert (batch.bias == float("-inf")).sum() == sum(width - sizes[g][1] for g in members) * BLOCK * 2
    assert len(plan.batches) >= 2  # the 30-row group and the 8-block ones cannot share one batch cheaply
    check(query, k_cache, v_cache, groups, plan, 3e-2)


def test_a_group_too_large_to_batch_goes_to_flash_attention(monkeypatch):
    query, k_cache, v_cache, groups = make_groups([(3, 2), (2, 6)], seed=5)
    monkeypatch.setattr(cpu_prefix, "SCORES_LIMIT", 2 * 6 * 6 * BLOCK - 1)
    plan = cpu_prefix.plan_prefixes(groups, 6, 2, BLOCK)
    assert plan.alone == [1] and len(plan.batches) == 1
    calls = []
    real = cpu_prefix.prefix_attention
    monkeypatch.setattr(cpu_prefix, "prefix_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    check(query, k_cache, v_cache, groups, plan, 3e-2)
    assert calls == [2]


def test_the_fastest_usable_kernel_is_timed_once_per_shape(monkeypatch):
    monkeypatch.delenv(cpu_prefix.CHOICE_ENV, raising=False)
    monkeypatch.setattr(cpu_prefix, "_choices", {})
    timed = []
    real = cpu_prefix.calibrate
    monkeypatch.setattr(cpu_prefix, "calibrate", lambda *key: timed.append(key) or real(*key))
    first = cpu_prefix.prefix_kernel(torch.bfloat16, 6, 2, 32, BLOCK)
    assert first in cpu_prefix.KERNELS
    assert all(cpu_prefix.prefix_kernel(torch.bfloat16, 6, 2, 32, BLOCK) == first for _ in range(3))
    assert timed == [(torch.bfloat16, 6, 2, 32, BLOCK)]
    assert cpu_prefix.prefix_kernel(torch.float32, 6, 2, 32, BLOCK) in ("native", "flash")  # never batched
    assert len(timed) == 2
    cpu_prefix.prefix_kernel(torch.bfloat16, 8, 1, 64, BLOCK)
    assert len(timed) == 3


def test_calibration_times_only_the_usable_kernels(monkeypatch):
    from pagedbatch_kernels.cpu import cpu_native

    monkeypatch.setattr(cpu_native, "takes", lambda *a: False)
    assert cpu_prefix.calibrate(torch.float32, 6, 2, 32, BLOCK, repeats=1) == "flash"  # the only one: not timed
    assert cpu_prefix.calibrate(torch.bfloat16, 6, 2, 32, BLOCK, repeats=1) in ("batched", "flash")


def test_the_choice_can_be_fixed_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_prefix, "calibrate", lambda *key: pytest.fail("timed although fixed"))
    for kernel in cpu_prefix.KERNELS:
        monkeypatch.setenv(cpu_prefix.CHOICE_ENV, kernel)
        assert cpu_prefix.prefix_kernel(torch.bfloat16, 6, 2, 32, BLOCK) == kernel
    monkeypatch.setenv(cpu_prefix.CHOICE_ENV, "batched")
    assert cpu_prefix.prefix_kernel(torch.float32, 6, 2, 32, BLOCK) == "flash"  # batched takes bfloat16 only
    monkeypatch.setenv(cpu_prefix.CHOICE_ENV, "native")
    assert cpu_prefix.prefix_kernel(torch.float16, 6, 2, 32, BLOCK) == "flash"  # nor the native kernel float16
    monkeypatch.setenv(cpu_prefix.CHOICE_ENV, "fastest")
    with pytest.raises(ValueError, match="PAGEDBATCH_CPU_PREFIX"):
        cpu_prefix.prefix_kernel(torch.bfloat16, 6, 2, 32, BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_native_groups_equal_the_naive_softmax(sizes, dtype):
    query, k_cache, v_cache, groups = make_groups(sizes, dtype=dtype, seed=len(sizes))
    plan = cpu_prefix.plan_for("native", groups, 6, 2, BLOCK)
    assert plan.bounds.tolist() == [[start, end] for start, end, _ in groups]
    # float32 scores and softmax, either pool; bfloat16 weights where the kernel multiplies bfloat16 pairs
    rounded = dtype == torch.bfloat16 and cpu_native.span_rounds_bf16_weights()
    check(query, k_cache, v_cache, groups, plan, 1e-5, out_tol=2**-8 * v_cache.abs().max().item() if rounded else None)


@pytest.mark.parametrize("choice", cpu_prefix.KERNELS)
def test_decodes_sharing_prefixes_equal_naive_every_way(monkeypatch, choice):
    from pagedbatch_kernels.cpu import cpu_attention, cpu_native
    from tests.kernels.test_reference import make_batch, with_shared_prefixes
    from tests.kernels.test_reference import naive as naive_attention

    monkeypatch.setenv(cpu_prefix.CHOICE_ENV, choice)
    prefix_calls = []
    real = cpu_prefix.prefix_attention
    monkeypatch.setattr(cpu_prefix, "prefix_attention", lambda *a: prefix_calls.append(1) or real(*a))
    span_calls = []  # the prefixes' and the 9-token chunk's
    real_spans = cpu_native.span_attention
    monkeypatch.setattr(cpu_native, "span_attention", lambda *a: span_calls.append(a[3].shape[0]) or real_spans(*a))
    batch = with_shared_prefixes(
        make_batch([1] * 7 + [9], [60, 48, 70, 32, 20, 31, 40, 30], 6, 2, torch.bfloat16, seed=6)
    )
    got = cpu_attention.paged_attention(**batch)
    torch.testing.assert_close(got.double(), naive_attention(**batch), atol=3e-2, rtol=3e-2)
    assert bool(prefix_calls) == (choice == "flash")
    assert len(span_calls) == (2 if choice == "native" else 0)
