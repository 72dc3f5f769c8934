"""Paged attention over a mixed batch of prefill chunks and single-token decodes.

Layout (see pagedbatch_kernels/reference.py): query [T, H, D] packed by sequence, k/v cache
[num_blocks, block_size, Hkv, D], block_tables [S, max_blocks], seq_lens [S] (context
length including the new tokens), query_start_loc [S + 1].

Two kernels share one inner loop (`_attend`, online softmax in fp32 with exp2):

* `_query_block_kernel` — one program per (block of query tokens, kv head). The rows of a
  program are BLOCK_Q tokens x GROUP query heads that share one kv head (GQA packing), so
  each K/V tile is loaded once for the whole group and QK^T / PV are `tl.dot`s. Programs
  find their sequence by a binary search over query_start_loc, so the grid only depends on
  tensor shapes (num_tokens // BLOCK_Q + num_seqs) and launching never syncs with the host.
  Causal masking covers prefill chunks with any cached prefix; a decode is a 1-token chunk.

* `_split_decode_kernel` + `_merge_splits_kernel` (flash-decoding) — when there are too
  few (sequence, kv head) pairs to fill the GPU, each decode's context is cut into
  NUM_SPLITS partitions computed by separate programs that write a partial output plus the
  running max and sum; the merge kernel combines them with a log-sum-exp. Partition
  lengths come from each sequence's own length on the device, so the split count is a
  host-side function of shapes only (safe to capture in a CUDA graph). Prefill chunks are
  then left to the query-block kernel, which skips the 1-token sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedbatch_kernels.attention_grid import (  # choose_num_splits: part of this module's API
    MAX_SPLITS,
    _block_config,
    _pow2,
    _search_steps,
    choose_num_splits,
)
from pagedbatch_kernels.paged_attention_kernels import (
    _merge_splits_kernel,
    _query_block_kernel,
    _split_decode_kernel,
)

LOG2E = 1.4426950408889634


def _compiled_for_gpu(t: torch.Tensor) -> bool:
    """False when the kernels run in Triton's CPU interpreter (tests patch this to check GPU configs)."""
    return t.is_cuda


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    Same contract as `pagedbatch_kernels.reference.paged_attention`. Optional host-side hints (all
    plain Python ints; nothing here reads device memory, so every call is graph-capturable):
      max_query_len: longest new-token run in the batch; 1 means decode-only, which skips the
        query-block launch when decodes are split and picks decode-sized tiles.
      max_seq_len: bound on seq_lens, used only to size the flash-decoding split count
        (default: the width of block_tables times the block size).
      num_splits: force the flash-decoding partition count (1 disables splitting; at most 32).
      out: preallocated [T, H, D] output (e.g. a CUDA-graph static buffer).
    `window` and `softcap` as in the reference (a sliding window, soft-capped scores).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    block_d = _pow2(head_dim, 16)
    on_gpu = _compiled_for_gpu(query)
    # Triton's CPU interpreter has no bf16 matmul: there the dots run in fp32.
    q_f32 = not on_gpu and query.dtype == torch.bfloat16
    precision = "ieee" if query.dtype == torch.float32 or q_f32 else "tf32"
    qk_scale = float(scale) * LOG2E
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    decode_only = max_query_len == 1 or (max_query_len is None and num_tokens == num_seqs)

    if num_splits is None:
        max_context = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    split_decodes = num_splits > 1

    common = _Common(
        group,
        group_pad,
        block_d,
        head_dim,
        block_size,
        precision,
        q_f32,
        qk_scale,
        cache_strides,
        int(window or 0),
        float(softcap or 0.0) * LOG2E,
    )
    if not (split_decodes and max_query_len == 1):
        _launch_query_blocks(
            query,
            k_cache,
            v_cache,
            out,
            block_tables,
            seq_lens,
            query_start_loc,
            common,
            decode_only=decode_only,
            on_gpu=on_gpu,
            skip_decodes=split_decodes,
        )
    if split_decodes:
        _launch_split_decode(
            query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, common, num_splits=num_splits
        )
    return out


class _Common(NamedTuple):
    """What every launch of one `paged_attention` call shares."""

    group: int
    group_pad: int
    block_d: int
    head_dim: int
    block_size: int
    precision: str
    q_f32: bool
    qk_scale: float
    cache_strides: tuple[int, int, int]
    window: int  # 0: none
    cap2: float  # the soft cap times log2(e); 0: none


def _launch_query_blocks(
    query,
    k_cache,
    v_cache,
    out,
    block_tables,
    seq_lens,
    query_start_loc,
    c: _Common,
    *,
    decode_only: bool,
    on_gpu: bool,
    skip_decodes: bool,
) -> None:
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    block_m, block_n, warps = _block_config(c.block_d, c.group_pad, decode_only, on_gpu, query.dtype == torch.float32)
    block_q = block_m // c.group_pad
    grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
    _query_block_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *c.cache_strides,
        num_seqs,
        c.qk_scale,
        c.window,
        c.cap2,
        GROUP=c.group,
        GROUP_PAD=c.group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=c.block_d,
        HEAD_DIM=c.head_dim,
        BLOCK_SIZE=c.block_size,
        SEARCH_STEPS=_search_steps(num_seqs),
        SKIP_DECODES=skip_decodes,
        DOT_PRECISION=c.precision,
        Q_F32=c.q_f32,
        WINDOWED=c.window > 0,
        SOFTCAP=c.cap2 > 0,
        num_warps=warps,
    )


def _launch_split_decode(
    query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, c: _Common, *, num_splits: int
) -> None:
    """Flash-decoding: each decode's context in `num_splits` partitions, then one merge."""
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    block_n = 64 if c.block_d <= 128 else 32
    part_out = torch.empty((num_seqs, num_heads, num_splits, c.head_dim), dtype=torch.float32, device=query.device)
    part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    _split_decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        query,
        k_cache,
        v_cache,
        part_out,
        part_m,
        part_l,
        block_tables,
        seq_lens,
        query_start_loc,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *c.cache_strides,
        num_heads,
        c.qk_scale,
        c.window,
        c.cap2,
        GROUP=c.group,
        BLOCK_M=max(16, c.group_pad),
        BLOCK_N=block_n,
        BLOCK_D=c.block_d,
        HEAD_DIM=c.head_dim,
        BLOCK_SIZE=c.block_size,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=c.precision,
        Q_F32=c.q_f32,
        WINDOWED=c.window > 0,
        SOFTCAP=c.cap2 > 0,
        num_warps=4,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out,
        part_m,
        part_l,
        out,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        num_heads,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=_pow2(num_splits),
        BLOCK_D=c.block_d,
        HEAD_DIM=c.head_dim,
        num_warps=4,
    )
