"""Sliding-window and soft-capped attention on the CPU engine's native kernels (`cpu_window`, the `lows`
and `softcap` of `csrc/cpu_decode.cpp` and `csrc/cpu_spans.cpp`) against the plain-torch reference, on
random pools of many shapes: decodes, short and long prompt chunks, chunks after a cached prefix, in one
step; and the blocks wholly behind every window never read."""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels import reference
from pagedbatch_kernels.cpu import cpu_attention, cpu_native, cpu_window

SHAPES = [  # heads, KV heads, head size, block size
    (4, 2, 64, 16),
    (8, 1, 128, 16),
    (4, 4, 32, 8),
    (8, 4, 256, 16),
    (6, 2, 80, 32),
    (4, 2, 16, 16),
]
# (context length, new tokens) per sequence: decodes, a whole prompt, chunks after a cached prefix
STEPS = [
    [(1, 1), (9, 1), (40, 1), (130, 1)],
    [(70, 70), (33, 1), (100, 20)],
    [(5, 5), (200, 64), (300, 1), (64, 64), (17, 3)],
    [(257, 130), (129, 1), (1, 1)],
]
WINDOWS = [None, 1, 7, 16, 50, 128]
CAPS = [None, 50.0, 2.0]


def random_step(heads, kv_heads, head_dim, block_size, dtype, step, seed, hide_behind=None):
    """A step's tensors; with `hide_behind` (a window), the block ids wholly behind every new token's
    window are replaced by -1 (a freed block: reading it would be an error)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n, _ in step) + 1
    num_blocks = len(step) * width + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    tables = torch.randperm(num_blocks, generator=gen)[: len(step) * width].view(-1, width).int()
    if hide_behind:
        for i, (length, q_len) in enumerate(step):
            tables[i, : reference.first_window_block(length, q_len, hide_behind, block_size)] = -1
    starts = [0]
    for _, q_len in step:
        starts.append(starts[-1] + q_len)
    return dict(
        query=torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor([n for n, _ in step], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=head_dim**-0.5 * 3,  # larger scores: the cap bites
    )


def test_the_native_kernels_take_these_shapes():
    for heads, kv_heads, head_dim, _ in SHAPES:
        assert cpu_native.takes(torch.float32, heads, kv_heads, head_dim)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_banded_float32_matches_the_reference(shape, step):
    for seed, (window, cap) in enumerate((w, c) for w in WINDOWS for c in CAPS if w or c):
        call = random_step(*shape, torch.float32, STEPS[step], seed, hide_behind=window)
        got = cpu_attention.paged_attention(**call, window=window, softcap=cap)
        want = reference.paged_attention(**call, window=window, softcap=cap)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=f"window {window}, cap {cap}")


@pytest.mark.parametrize("step", range(len(STEPS)))
def test_banded_bfloat16_matches_the_reference(step):
    """bfloat16 pools: the kernels' scores in float32 (the span kernel's softmax weights may be rounded
    to bfloat16, as transformers does): within bfloat16's rounding of the float32 reference's output."""
    for seed, (window, cap) in enumerate([(16, None), (None, 50.0), (50, 30.0)]):
        call = random_step(8, 2, 64, 16, torch.bfloat16, STEPS[step], seed, hide_behind=window)
        got = cpu_attention.paged_attention(**call, window=window, softcap=cap).float()
        upcast = {n: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in call.items()}
        want = reference.paged_attention(**upcast, window=window, softcap=cap)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_decode_rows_see_their_window_only():
    """The native decode kernel's `lows`: row r's positions before lows[r] carry no weight."""
    call = random_step(4, 2, 64, 16, torch.float32, [(40, 1), (33, 1)], 0)
    q, tables = call["query"], call["block_tables"]
    lows = torch.tensor([25, 0], dtype=torch.int32)
    out, lse = cpu_native.decode_attention(
        q, call["k_cache"], call["v_cache"], tables, call["seq_lens"], 0.1, lows=lows
    )
    for r, (length, low) in enumerate(zip([40, 33], [25, 0])):
        slots = [tables[r, p // 16].item() * 16 + p % 16 for p in range(low, length)]
        k = call["k_cache"].flatten(0, 1)[slots].double().repeat_interleave(2, dim=1)
        v = call["v_cache"].flatten(0, 1)[slots].double().repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[r].double(), k) * 0.1
        torch.testing.assert_close(lse[r].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)
        want = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
        torch.testing.assert_close(out[r].double(), want, atol=1e-5, rtol=1e-5)


def test_soft_cap_is_tanh_over_the_range():
    """The kernels' vector tanh (a series near 0, exp beyond) against torch's, scores from 0 to 40 caps."""
    call = random_step(4, 4, 32, 16, torch.float32, [(64, 1)], 0)
    call["query"] = call["query"] * torch.logspace(-4, 2, 4)[:, None]  # per head: tiny to huge scores
    for cap in (1.0, 30.0):
        got = cpu_attention.paged_attention(**call, softcap=cap)
        want = reference.paged_attention(**call, softcap=cap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_plan_per_step_and_window():
    call = random_step(4, 2, 64, 16, torch.float32, STEPS[1], 0)
    meta = (call["block_tables"], call["seq_lens"], call["query_start_loc"], 16)
    first = cpu_window._step_plan(*meta, 16)
    assert cpu_window._step_plan(*meta, 16) is first
    assert cpu_window._step_plan(*meta, None) is not first
    assert cpu_window._step_plan(*meta, 16) is first  # both kept within the step


def test_portable_build_bands_and_caps_alike(baseline_library):
    """The kernels built for the compiler's baseline target (4-lane vectors): the same lows and caps."""
    call = random_step(4, 2, 64, 16, torch.float32, [(90, 1), (70, 1)], 0)
    args = (call["query"], call["k_cache"], call["v_cache"], call["block_tables"], call["seq_lens"], 0.3)
    lows = torch.tensor([60, 5], dtype=torch.int32)
    native = cpu_native.decode_attention(*args, lows=lows, softcap=2.0)
    portable = cpu_native.decode_attention(*args, baseline_library, lows=lows, softcap=2.0)
    for got, want in zip(portable, native):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([[0, 2]], dtype=torch.int32)  # both rows as one span over the first table
    span_args = (call["query"], call["k_cache"], call["v_cache"], call["block_tables"][:1], rows)
    span_lens = torch.tensor([90, 40], dtype=torch.int32)
    native = cpu_native.span_attention(*span_args, span_lens, 0.3, lows=lows, softcap=2.0)
    portable = cpu_native.span_attention(*span_args, span_lens, 0.3, baseline_library, lows=lows, softcap=2.0)
    for got, want in zip(portable, native):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
