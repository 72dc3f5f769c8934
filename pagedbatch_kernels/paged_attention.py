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
import triton
import triton.language as tl

from pagedbatch_kernels.attention_grid import (  # noqa: F401 - choose_num_splits: part of this module's API
    MAX_SPLITS,
    _block_config,
    _pow2,
    _search_steps,
    choose_num_splits,
)

LOG2E = 1.4426950408889634


def _compiled_for_gpu(t: torch.Tensor) -> bool:
    """False when the kernels run in Triton's CPU interpreter (tests patch this to check GPU configs)."""
    return t.is_cuda


@triton.jit
def _attend(
    q, acc, m_i, l_i, q_pos, k_lo, k_hi,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_cb, stride_cs, stride_ch, qk_scale, window, cap2,
    CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Fold keys [k_lo, k_hi) of one sequence into the online-softmax state (acc, m_i, l_i).

    q [BLOCK_M, BLOCK_D]; acc [BLOCK_M, BLOCK_D] fp32; m_i (log2 domain), l_i [BLOCK_M] fp32;
    q_pos [BLOCK_M]: the position of each row's token, used when CAUSAL (and then, WINDOWED, keys
    before q_pos - window + 1 are masked); SOFTCAP: scores s become cap * tanh(s / cap), cap2 = cap * log2(e).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head_off = kv_head * stride_ch
    for start in range(k_lo, k_hi, BLOCK_N):
        k_pos = start + offs_n
        n_mask = k_pos < k_hi
        page = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row_off = page * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), in the log2 domain of the scores
            qk = cap2 * (1.0 - 2.0 / (tl.exp(2.0 * qk / cap2) + 1.0))
        if CAUSAL:
            keep = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if WINDOWED:
                keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
        else:
            keep = n_mask[None, :]
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _query_block_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, seq_lens_ptr, qsl_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cb, stride_cs, stride_ch,
    num_seqs, qk_scale, window, cap2,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, SKIP_DECODES: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_F32: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Sequence i owns the global query blocks [qsl[i] // BLOCK_Q + i, ...): find the last
    # sequence whose first block is <= q_block (branch-free binary search, lo < hi).
    lo = q_block * 0
    hi = lo + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid, mask=active, other=0) // BLOCK_Q + mid
        lo = tl.where(active & (first <= q_block), mid + 1, lo)
        hi = tl.where(active & (first > q_block), mid, hi)
    seq = lo - 1

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    done = local_block * BLOCK_Q >= q_len
    if SKIP_DECODES:
        done = done | (q_len == 1)  # 1-token sequences are left to the flash-decoding kernels
    if done:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = local_block * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_mask = (offs_m % GROUP_PAD < GROUP) & (tok < q_len)
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    token = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if Q_F32:  # the dots (and so K, V, P) follow q's dtype
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys past the last token of this block are masked for every row: stop there.
    k_hi = prefix + tl.minimum(q_len, (local_block + 1) * BLOCK_Q)
    k_lo = k_hi * 0
    if WINDOWED:  # keys before the first row's window are masked for every row: start there
        k_lo = tl.maximum(k_lo, prefix + local_block * BLOCK_Q - window + 1)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, prefix + tok, k_lo, k_hi,
        k_cache_ptr, v_cache_ptr, tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
        stride_cb, stride_cs, stride_ch, qk_scale, window, cap2,
        True, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WINDOWED, SOFTCAP,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_m_ptr, part_l_ptr,
    tables_ptr, seq_lens_ptr, qsl_ptr,
    stride_qt, stride_qh, stride_table, stride_cb, stride_cs, stride_ch,
    num_heads, qk_scale, window, cap2,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    Q_F32: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first = seq_len * 0
    if WINDOWED:  # the partitions cover the window only
        first = tl.maximum(first, seq_len - window)
    part_len = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    k_lo = first + split * part_len
    k_hi = tl.minimum(seq_len, k_lo + part_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + offs_m
    row_mask = offs_m < GROUP
    mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if Q_F32:  # the dots (and so K, V, P) follow q's dtype
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, offs_m, k_lo, k_hi,
        k_cache_ptr, v_cache_ptr, tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
        stride_cb, stride_cs, stride_ch, qk_scale, window, cap2,
        False, BLOCK_SIZE, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION, WINDOWED, SOFTCAP,
    )
    # Partial results are laid out [seq, head, split(, dim)]; an empty split stores l = 0.
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
    tl.store(part_m_ptr + row, m_i, mask=row_mask)
    tl.store(part_l_ptr + row, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, qsl_ptr,
    stride_ot, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    splits = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = splits < NUM_SPLITS
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + row, mask=s_mask, other=-1.0e30)
    weight = tl.exp2(m - tl.max(m, axis=0)) * tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(weight, axis=0)  # 0 only for an empty context (a padded graph slot): write zeros
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


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

    common = _Common(group, group_pad, block_d, head_dim, block_size, precision, q_f32, qk_scale, cache_strides,
                     int(window or 0), float(softcap or 0.0) * LOG2E)
    if not (split_decodes and max_query_len == 1):
        _launch_query_blocks(query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, common,
                             decode_only=decode_only, on_gpu=on_gpu, skip_decodes=split_decodes)
    if split_decodes:
        _launch_split_decode(query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, common,
                             num_splits=num_splits)
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


def _launch_query_blocks(query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, c: _Common, *,
                         decode_only: bool, on_gpu: bool, skip_decodes: bool) -> None:
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    block_m, block_n, warps = _block_config(c.block_d, c.group_pad, decode_only, on_gpu, query.dtype == torch.float32)
    block_q = block_m // c.group_pad
    grid = (num_tokens // block_q + num_seqs, k_cache.shape[2])
    _query_block_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *c.cache_strides,
        num_seqs, c.qk_scale, c.window, c.cap2,
        GROUP=c.group, GROUP_PAD=c.group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=c.block_d, HEAD_DIM=c.head_dim, BLOCK_SIZE=c.block_size,
        SEARCH_STEPS=_search_steps(num_seqs), SKIP_DECODES=skip_decodes,
        DOT_PRECISION=c.precision, Q_F32=c.q_f32, WINDOWED=c.window > 0, SOFTCAP=c.cap2 > 0, num_warps=warps,
    )


def _launch_split_decode(query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, c: _Common, *,
                         num_splits: int) -> None:
    """Flash-decoding: each decode's context in `num_splits` partitions, then one merge."""
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    block_n = 64 if c.block_d <= 128 else 32
    part_out = torch.empty((num_seqs, num_heads, num_splits, c.head_dim), dtype=torch.float32, device=query.device)
    part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    _split_decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        query, k_cache, v_cache, part_out, part_m, part_l, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), block_tables.stride(0), *c.cache_strides,
        num_heads, c.qk_scale, c.window, c.cap2,
        GROUP=c.group, BLOCK_M=max(16, c.group_pad), BLOCK_N=block_n, BLOCK_D=c.block_d, HEAD_DIM=c.head_dim,
        BLOCK_SIZE=c.block_size, NUM_SPLITS=num_splits, DOT_PRECISION=c.precision, Q_F32=c.q_f32,
        WINDOWED=c.window > 0, SOFTCAP=c.cap2 > 0, num_warps=4,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_m, part_l, out, query_start_loc,
        out.stride(0), out.stride(1), num_heads,
        NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), BLOCK_D=c.block_d, HEAD_DIM=c.head_dim,
        num_warps=4,
    )
