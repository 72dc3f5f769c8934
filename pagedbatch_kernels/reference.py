"""Plain-torch reference implementations of every kernel the engine uses.

Shapes used throughout:
  query   [num_tokens, num_heads, head_dim]   (the new tokens of every sequence, packed)
  key/val [num_tokens, num_kv_heads, head_dim]
  k_cache [num_blocks, block_size, num_kv_heads, head_dim] (v_cache alike)
  slot_mapping [num_tokens] int64: block_id * block_size + offset, or -1 to skip
  block_tables [num_seqs, max_blocks_per_seq] int32
  seq_lens [num_seqs] int32: context length of each sequence *including* its new tokens
  query_start_loc [num_seqs + 1] int32: prefix sums of the number of new tokens per sequence

The new tokens of sequence i sit at positions seq_lens[i] - q_len_i .. seq_lens[i] - 1
and attend causally to everything before them, cached or new. With a `window` W, a token at p
attends to positions p - W + 1 .. p only (transformers' sliding window), and blocks wholly before
every new token's window are not read; with `softcap` c, scaled scores s become c * tanh(s / c)
(Gemma 2) before the mask and the softmax; with `sinks` [num_heads] (gpt-oss), each head's sink
logit joins the softmax's denominator as one more score that has no value.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

# Per-thread scratch reused across steps and layers. Freshly allocated tensors of tens of MB
# cost more in page faults than the copy into them, so the K/V gathers and the masks
# go into memory that is already mapped. Bounded: the gather buffers hold the largest context
# gathered so far (at most max_num_seqs x max_model_len tokens), the mask cache MAX_MASKS masks.
_scratch = threading.local()
MAX_MASKS = 32


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots, key, value = slot_mapping[keep], key[keep], value[keep]
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def _buffer(name, cache, num_blocks):
    """A [num_blocks, *cache.shape[1:]] view of a reused buffer of the thread's scratch."""
    rows = getattr(_scratch, "buffers", None)
    if rows is None:
        rows = _scratch.buffers = {}
    key = (name, cache.dtype, cache.device, cache.shape[1:])
    buf = rows.get(key)
    if buf is None or buf.shape[0] < num_blocks:
        buf = rows[key] = torch.empty((num_blocks, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    return buf[:num_blocks]


def _gather_blocks(name, cache, blocks):
    return torch.index_select(cache, 0, blocks, out=_buffer(name, cache, blocks.shape[0]))


def _gather_context(name, cache, block_table, length):
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return _gather_blocks(name, cache, block_table[:num_blocks].long()).flatten(0, 1)[:length]


def _causal_mask(q_len, length, dtype, device):
    """[q_len, length] additive mask of new tokens at the end of the context (cached by shape:
    every layer of a step asks for the same ones)."""
    masks = getattr(_scratch, "masks", None)
    if masks is None:
        masks = _scratch.masks = {}
    key = (q_len, length, dtype, device)
    mask = masks.get(key)
    if mask is None:
        if len(masks) >= MAX_MASKS:
            masks.clear()
        q_pos = torch.arange(length - q_len, length, device=device)
        mask = masks[key] = _additive(torch.arange(length, device=device)[None, :] <= q_pos[:, None], dtype)
    return mask


def paged_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Causal attention of each sequence's new tokens over its paged context (or its last `window`
    positions), scores optionally soft-capped, softmax optionally with sinks."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    decodes = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] == 1]
    if decodes:
        _decode_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            lengths,
            starts,
            decodes,
            scale,
            out,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    if window or softcap or sinks is not None:
        banded_prefill_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            lengths,
            starts,
            scale,
            out,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    else:
        prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out)
    return out


def first_window_block(length: int, q_len: int, window: int | None, block_size: int) -> int:
    """The first block that the window of any of a sequence's `q_len` new tokens reaches."""
    if not window:
        return 0
    return max(0, length - q_len - window + 1) // block_size


def banded_prefill_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    lengths,
    starts,
    scale,
    out,
    *,
    window=None,
    softcap=None,
    sinks=None,
    seqs=None,
):
    """`prefill_attention` with a sliding window, soft-capped scores and/or sinks: the blocks from the
    first one any new token's window reaches, one explicit mask per sequence; soft-capped scores and
    sinks are computed as transformers' eager attention does (matmul, float32 softmax)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for i in range(len(lengths)) if seqs is None else seqs:
        length, q_len = lengths[i], starts[i + 1] - starts[i]
        if q_len <= 1:
            continue
        first = first_window_block(length, q_len, window, block_size)
        offset = first * block_size
        table = block_tables[i][first:]
        q = query[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)
        k = _gather_context("k", k_cache, table, length - offset).transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = _gather_context("v", v_cache, table, length - offset).transpose(0, 1).unsqueeze(0).to(q.dtype)
        q_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        k_pos = torch.arange(offset, length, device=q.device)[None, :]
        keep = k_pos <= q_pos
        if window:
            keep &= k_pos > q_pos - window
        eager = softcap or sinks is not None
        mask = _additive(keep, torch.float32 if eager else q.dtype)
        if eager:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
            if softcap:
                scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
            probs = _softmax(scores + mask, None if sinks is None else sinks.view(1, -1, 1, 1))
            o = torch.matmul(probs.to(v.dtype), v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=group > 1)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)


def prefill_attention(query, k_cache, v_cache, block_tables, lengths, starts, scale, out, seqs=None):
    """Into `out`: the attention of every sequence with more than one new token, or of those in `seqs`
    (host-side `lengths` and `starts` as the lists of seq_lens and query_start_loc).

    Masks are additive float tensors on 4-D inputs: that is what keeps PyTorch's CPU SDPA on
    its flash kernel (a boolean mask, or 3-D inputs with a mask, fall back to the math kernel,
    which materialises every score and is several times slower on long contexts)."""
    gqa = query.shape[1] != k_cache.shape[2]
    for i in range(len(lengths)) if seqs is None else seqs:
        length, q_len = lengths[i], starts[i + 1] - starts[i]
        if q_len <= 1:
            continue
        q = query[starts[i] : starts[i + 1]].transpose(0, 1).unsqueeze(0)
        k = _gather_context("k", k_cache, block_tables[i], length).transpose(0, 1).unsqueeze(0).to(q.dtype)
        v = _gather_context("v", v_cache, block_tables[i], length).transpose(0, 1).unsqueeze(0).to(q.dtype)
        if q_len == length:  # no cached prefix: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # new tokens at the end of the context: causal aligned to the bottom right
            mask = _causal_mask(q_len, length, q.dtype, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
        out[starts[i] : starts[i + 1]] = o[0].transpose(0, 1)


def _softmax(scores, sinks):
    """Softmax over the last dimension in float32, with a sink logit per row (broadcast from `sinks`)
    in the denominator where there are sinks."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _additive(keep, dtype):
    """A boolean keep-mask as 0 / -inf in `dtype`."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def _decode_attention(
    query, k_cache, v_cache, block_tables, lengths, starts, rows, scale, out, *, window=None, softcap=None, sinks=None
):
    """All single-token queries at once, grouped by shared prefix: sequences whose block tables
    start with the same blocks (a common system prompt, sibling samples) read those blocks once
    for the whole group, and only their own tails are gathered per sequence, padded and masked.
    With a window, each table starts at its window's first block (the blocks before are not read)."""
    block_size = k_cache.shape[1]
    tables = block_tables[torch.tensor(rows, device=block_tables.device)].tolist()
    lens = [lengths[r] for r in rows]
    lows = None
    if window:
        firsts = [first_window_block(n, 1, window, block_size) for n in lens]
        tables = [t[f:] for t, f in zip(tables, firsts)]
        lens = [n - f * block_size for n, f in zip(lens, firsts)]
        lows = [max(0, n - window) for n in lens]
    for members, shared in shared_prefixes(tables, lens, block_size):
        _decode_group(
            query,
            k_cache,
            v_cache,
            [tables[i] for i in members],
            [lens[i] for i in members],
            [starts[rows[i]] for i in members],
            shared,
            scale,
            out,
            lows=None if lows is None else [lows[i] for i in members],
            softcap=softcap,
            sinks=sinks,
        )


def shared_prefixes(tables: list[list[int]], lengths: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """(members, shared blocks) of decodes whose tables start with the same blocks, short of each
    member's own last token; the decodes that share nothing come last, together, with 0."""
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(i)
    groups, alone = [], []
    for members in by_first.values():
        shared = 0
        if len(members) > 1:
            limit = (min(lengths[i] for i in members) - 1) // block_size
            # rows of one prompt chunk hold the same table object: compare each table once; the
            # blocks all tables start with are those the lowest and the highest of them start with
            distinct = list({id(tables[i]): tables[i] for i in members}.values())
            low, high = min(distinct), max(distinct)
            while shared < limit and low[shared] == high[shared]:
                shared += 1
        if shared:
            groups.append((members, shared))
        else:
            alone.extend(members)
    return groups + ([(alone, 0)] if alone else [])


def _decode_group(
    query, k_cache, v_cache, tables, lengths, token_starts, shared, scale, out, lows=None, softcap=None, sinks=None
):
    """Decode attention of sequences whose first `shared` blocks are the same ones (each member's
    positions before its `lows` entry masked, scores soft-capped at `softcap`, `sinks` per head)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device, batch = query.device, len(tables)
    group = query.shape[1] // num_kv_heads
    prefix = shared * block_size
    tail = max(lengths) - prefix
    tail_blocks = -(-tail // block_size)
    tail_ids = torch.tensor(
        [t[shared : shared + tail_blocks] + [0] * (shared + tail_blocks - len(t)) for t in tables], device=device
    ).flatten()

    def tails(name, cache):  # [B, kv_heads, tail, D]
        ctx = _gather_blocks(name, cache, tail_ids).view(batch, -1, num_kv_heads, head_dim)[:, :tail]
        return ctx.transpose(1, 2).to(query.dtype)

    token_idx = torch.tensor(token_starts, device=device)
    # Plain batched matmuls over [B, kv_heads, group, ...]: one query per sequence is too little
    # work for the flash kernel (which in bfloat16 is ~10x slower here). Scores are scaled and
    # soft-maxed in float32, as transformers' eager attention does.
    q = query[token_idx].view(batch, num_kv_heads, group, head_dim)
    k, v = tails("k", k_cache), tails("v", v_cache)
    scores = torch.matmul(q, k.transpose(-1, -2)).float()
    if prefix:  # the shared blocks once, every member's queries as rows: [kv_heads, B * group, prefix]
        ids = torch.tensor(tables[0][:shared], device=device)
        kp = _gather_blocks("kp", k_cache, ids).view(prefix, num_kv_heads, head_dim).permute(1, 2, 0).to(q.dtype)
        vp = _gather_blocks("vp", v_cache, ids).view(prefix, num_kv_heads, head_dim).transpose(0, 1).to(q.dtype)
        qp = q.transpose(0, 1).reshape(num_kv_heads, batch * group, head_dim)
        shared_scores = torch.matmul(qp, kp).float().view(num_kv_heads, batch, group, prefix).transpose(0, 1)
        scores = torch.cat([shared_scores, scores], dim=-1)
    scores.mul_(scale)
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    cols = torch.arange(prefix + tail, device=device)[None, :]
    keep = cols < torch.tensor(lengths, device=device)[:, None]
    if lows is not None:
        keep &= cols >= torch.tensor(lows, device=device)[:, None]
    scores += _additive(keep, torch.float32)[:, None, None]
    probs = _softmax(scores, None if sinks is None else sinks.view(num_kv_heads, group, 1)).to(v.dtype)
    o = torch.matmul(probs[..., prefix:], v)
    if prefix:
        pp = probs[..., :prefix].transpose(0, 1).reshape(num_kv_heads, batch * group, prefix)
        o += torch.matmul(pp, vp).view(num_kv_heads, batch, group, head_dim).transpose(0, 1)
    out[token_idx] = o.reshape(batch, -1, head_dim)


def rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def apply_rotary(query, key, positions, cos_sin_cache):
    """Neox-style rotary embedding (rotate halves), as used by the Llama family.

    query [T, H, D], key [T, Hkv, D], cos_sin_cache [max_pos, D] = cat(cos, sin) over D/2 each.
    Returns new tensors.
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
