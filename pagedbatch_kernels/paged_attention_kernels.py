"""The Triton kernels behind `pagedbatch_kernels.paged_attention` (which documents the layout and chooses
the launch): `_attend`, the shared online-softmax inner loop; `_query_block_kernel`, one program per (block of
query tokens, kv head); `_split_decode_kernel` + `_merge_splits_kernel`, flash-decoding for few long decodes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend(
    q,
    acc,
    m_i,
    l_i,
    q_pos,
    k_lo,
    k_hi,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    qk_scale,
    window,
    cap2,
    CAUSAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_cb,
    stride_cs,
    stride_ch,
    num_seqs,
    qk_scale,
    window,
    cap2,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_F32: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
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
        q,
        acc,
        m_i,
        l_i,
        prefix + tok,
        k_lo,
        k_hi,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq.to(tl.int64) * stride_table,
        kv_head,
        stride_cb,
        stride_cs,
        stride_ch,
        qk_scale,
        window,
        cap2,
        True,
        BLOCK_SIZE,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM,
        DOT_PRECISION,
        WINDOWED,
        SOFTCAP,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _split_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    stride_qt,
    stride_qh,
    stride_table,
    stride_cb,
    stride_cs,
    stride_ch,
    num_heads,
    qk_scale,
    window,
    cap2,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_F32: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0
    )
    if Q_F32:  # the dots (and so K, V, P) follow q's dtype
        q = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        q,
        acc,
        m_i,
        l_i,
        offs_m,
        k_lo,
        k_hi,
        k_cache_ptr,
        v_cache_ptr,
        tables_ptr + seq.to(tl.int64) * stride_table,
        kv_head,
        stride_cb,
        stride_cs,
        stride_ch,
        qk_scale,
        window,
        cap2,
        False,
        BLOCK_SIZE,
        BLOCK_N,
        BLOCK_D,
        HEAD_DIM,
        DOT_PRECISION,
        WINDOWED,
        SOFTCAP,
    )
    # Partial results are laid out [seq, head, split(, dim)]; an empty split stores l = 0.
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
    tl.store(part_m_ptr + row, m_i, mask=row_mask)
    tl.store(part_l_ptr + row, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
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
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
