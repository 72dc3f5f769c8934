"""The plain-torch paged attention (the CPU engine's kernel) against a naive per-token
softmax: with its scratch buffers reused across calls of different shapes, with decodes that
share prefix blocks (read once per group), and kept on PyTorch's flash SDPA kernel for
prefill (the math fallback materialises every score)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from pagedbatch_kernels import reference


def make_batch(q_lens, ctx_lens, num_heads, num_kv_heads, dtype, head_dim=32, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    width = max(-(-n // block_size) for n in seq_lens) + 1
    num_blocks = len(q_lens) * width + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=torch.randperm(num_blocks, generator=gen)[: len(q_lens) * width].view(len(q_lens), width).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def naive(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """Token by token in float64: softmax over the context up to and including its own position."""
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        slots = [block_tables[i, p // block_size].item() * block_size + p % block_size for p in range(length)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            pos = length - q_len + j
            q = query[starts[i] + j].double()  # [H, D]
            w = torch.softmax(torch.einsum("hd,lhd->hl", q, k[: pos + 1]) * scale, dim=-1)
            out[starts[i] + j] = torch.einsum("hl,lhd->hd", w, v[: pos + 1])
    return out


# decodes, a fresh prefill, chunks after a cached prefix (at and off block boundaries)
LARGE = ([1, 1, 1, 40, 9, 1, 23], [70, 15, 33, 0, 48, 16, 17])
SMALL = ([1, 5, 1], [3, 16, 31])
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_matches_naive_across_reused_scratch(heads, dtype):
    for case, seed in ((LARGE, 0), (SMALL, 1), (LARGE, 2)):  # the scratch shrinks, then grows again
        batch = make_batch(*case, *heads, dtype, seed=seed)
        got = reference.paged_attention(**batch)
        assert got.dtype == dtype and got.shape == batch["query"].shape
        expected = naive(**batch)
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < TOL[dtype], f"{case}: max rel err {err:.3g}"


def with_shared_prefixes(batch):
    """Decodes 0-3 share their first 3 blocks (one a block short of its own token), 4-5 their
    first block; 6 and the prefill chunk share nothing."""
    tables = batch["block_tables"].clone()
    tables[1:4, :3] = tables[0, :3]
    tables[5, :1] = tables[4, :1]
    return {**batch, "block_tables": tables}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_decodes_sharing_prefix_blocks_match_naive(heads, dtype):
    case = ([1, 1, 1, 1, 1, 1, 1, 9], [60, 48, 70, 32, 20, 31, 40, 30])
    for seed in (0, 1):
        batch = with_shared_prefixes(make_batch(*case, *heads, dtype, seed=seed))
        got = reference.paged_attention(**batch)
        expected = naive(**batch)
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < TOL[dtype], f"max rel err {err:.3g}"


def test_stays_on_the_flash_kernel():
    batch = make_batch(*LARGE, 6, 2, torch.float32)
    with profile() as prof:
        reference.paged_attention(**batch)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
