"""Triton paged attention vs the plain-torch twin on mixed batches of prefill chunks and decodes.

On CPU the kernels run through Triton's interpreter (see conftest.py), so sizes stay small;
with CUDA the same cases also run in bf16.
"""

from __future__ import annotations

import pytest
import torch

from pagedbatch_kernels import reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}

triton_ops = pytest.importorskip("pagedbatch_kernels.triton_ops")


def make_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random queries and a shuffled paged cache: sequence i has ctx_lens[i] cached tokens + q_lens[i] new."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    width = max(-(-n // block_size) for n in seq_lens) + 1  # a spare column, as the engine pads tables
    num_blocks = len(q_lens) * width + 5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(q_lens) * width].view(len(q_lens), width)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)

    def dev(t, dt=None):
        return t.to(device=DEVICE, dtype=dt or t.dtype)

    return dict(
        query=dev(query, dtype),
        k_cache=dev(k_cache, dtype),
        v_cache=dev(v_cache, dtype),
        block_tables=dev(tables, torch.int32),
        seq_lens=dev(torch.tensor(seq_lens), torch.int32),
        query_start_loc=dev(torch.tensor(starts), torch.int32),
        scale=head_dim**-0.5,
    )


def check(batch, dtype, **kwargs):
    expected = reference.paged_attention(**batch)
    got = triton_ops.paged_attention(**batch, **kwargs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err < TOL[dtype], f"max rel err {err:.3g}"


# Ragged contexts at and around block boundaries: decodes, fresh prefills, chunks with a prefix.
MIXED = (
    [1, 1, 1, 1, 1, 1, 7, 17, 1, 5],
    [14, 15, 16, 30, 31, 32, 0, 16, 64, 27],
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (8, 1)], ids=lambda h: f"gqa{h[0] // h[1]}")
def test_mixed_batch(heads, head_dim, block_size, dtype):
    batch = make_batch(*MIXED, *heads, head_dim, block_size, dtype)
    check(batch, dtype, num_splits=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"gqa{h[0] // h[1]}")
def test_mixed_batch_split_decodes(heads, num_splits, dtype):
    """Flash-decoding for the decodes, query-block kernel for the chunks, in one call."""
    batch = make_batch(*MIXED, *heads, 64, 16, dtype, seed=1)
    check(batch, dtype, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 4, 32])
def test_long_decodes(num_splits, dtype):
    """Decode-only batch with long contexts: several partitions, some sequences shorter than others."""
    batch = make_batch([1, 1, 1], [700, 63, 300], 8, 1, 64, 16, dtype, seed=2)
    if num_splits is None and not CUDA:
        assert triton_ops.triton_attention.__name__ == "pagedbatch_kernels.paged_attention"
        from pagedbatch_kernels.paged_attention import choose_num_splits

        assert choose_num_splits(3, 1, 701, DEVICE) > 1  # the default does split this batch
    check(batch, dtype, num_splits=num_splits)
    check(batch, dtype, num_splits=num_splits, max_query_len=1, max_seq_len=701)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_long_prefix_chunks(block_size, dtype):
    """Prefill chunks behind a few hundred cached tokens, next to a long decode."""
    batch = make_batch([24, 1, 33], [300, 400, 0], 4, 2, 64, block_size, dtype, seed=3)
    check(batch, dtype)
    check(batch, dtype, num_splits=1)


@pytest.mark.parametrize("head_dim", [16, 32, 48, 80])
def test_small_and_odd_head_dims(head_dim):
    """The tiny test models use head dims 16/32; non powers of two are padded."""
    dtype = DTYPES[-1]
    batch = make_batch([3, 1, 1, 9], [13, 16, 40, 0], 4, 2, head_dim, 16, dtype, seed=4)
    check(batch, dtype)
    check(batch, dtype, num_splits=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_half_precision(num_splits, dtype):
    """bf16/fp16 everywhere; on CPU the interpreter runs the dots in fp32 (it has no bf16 matmul)."""
    batch = make_batch([1, 6, 1, 20], [47, 10, 16, 33], 8, 2, 64, 16, dtype, seed=9)
    check(batch, dtype, num_splits=num_splits)


def test_empty_and_single_token_chunks():
    """A sequence with no new tokens writes nothing; a 1-token chunk over a prefix is a decode."""
    dtype = DTYPES[-1]
    batch = make_batch([4, 0, 1, 2], [5, 10, 0, 31], 4, 1, 32, 16, dtype, seed=5)
    out = torch.zeros_like(batch["query"])
    got = triton_ops.paged_attention(**batch, out=out, num_splits=2)
    assert got is out
    check(batch, dtype)


def test_strided_query_view():
    """The query may be a view into a fused QKV projection."""
    dtype = DTYPES[-1]
    batch = make_batch([3, 1, 6], [2, 20, 17], 4, 2, 32, 16, dtype, seed=6)
    q = batch["query"]
    qkv = torch.randn(q.shape[0], 8 * 32, device=DEVICE, dtype=dtype)
    qkv[:, : 4 * 32] = q.flatten(1)
    batch["query"] = qkv[:, : 4 * 32].view(q.shape[0], 4, 32)
    assert not batch["query"].is_contiguous()
    check(batch, dtype)


@pytest.mark.gpu  # CUDA graphs
def test_decode_replays_in_cuda_graph():
    """Decode with host-side hints only: capture once, change lengths on the device, replay."""
    dtype = torch.bfloat16
    batch = make_batch([1] * 8, [100, 5, 640, 3000, 1, 17, 2500, 33], 16, 8, 128, 16, dtype, seed=7)
    hints = dict(max_query_len=1, max_seq_len=batch["block_tables"].shape[1] * 16)
    from pagedbatch_kernels.paged_attention import choose_num_splits

    assert choose_num_splits(8, 8, hints["max_seq_len"], DEVICE) > 1  # flash-decoding inside the graph
    out = torch.empty_like(batch["query"])
    triton_ops.paged_attention(**batch, out=out, **hints)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_ops.paged_attention(**batch, out=out, **hints)
    batch["seq_lens"].copy_(torch.tensor([9, 6, 2000, 3001, 2, 3, 2501, 34], device=DEVICE))
    graph.replay()
    expected = reference.paged_attention(**batch)
    err = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    assert err < TOL[dtype]


@pytest.mark.gpu  # large shapes
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)])
def test_large_mixed_batch_gpu(heads):
    q_lens = [1] * 40 + [512, 77, 1000]
    ctx_lens = [int(x) for x in torch.randint(1, 3000, (40,))] + [0, 1500, 48]
    batch = make_batch(q_lens, ctx_lens, *heads, 128, 16, torch.bfloat16, seed=8)
    check(batch, torch.bfloat16)
    check(batch, torch.bfloat16, num_splits=8)
