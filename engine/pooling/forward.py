"""A leaner forward pass for CPU steps made only of pooling prompts.

Each sequence's attention runs on the K/V just computed (SDPA per sequence, its queries in pieces
of `QUERY_PIECE` rows: CPU SDPA's flash kernel runs causal attention ~1.5x faster that way) instead
of gathering them back from the paged cache; only a chunk that continues a prompt (chunked prefill,
or a prefix-cache hit) reads its earlier positions from the cache. The cache is written only when
something will read it (prefix caching on, or a prompt that continues in a later chunk).

The step runs in groups of whole sequences of about `CPU_GROUP_TOKENS` tokens. In the last layer
only the rows that pooling reads go on past attention (the last token for last-token pooling, the
first for CLS, all for mean): the other rows' o_proj, MLP and final norm are skipped, their K/V
still serve the kept rows' attention.

A vector does not depend on what its sequence was batched with, bit for bit (the worker's vectors
equal the offline engine's): every GEMM runs on at least `MIN_GEMM_ROWS` rows, where the CPU BLAS
computes each row as it would in any larger GEMM (below, e.g. 1 to 11 rows on two threads, it
takes other kernels that round differently), and attention is per sequence.

The layers' own modules (norms, rotary) and weights do the work, in the order of
`engine.models.llama`, the GEMMs through oneDNN with packed weights on the CPU (`engine.runner.cpu_linear`); a
model without that structure takes the generic path (`supports`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.core.scheduler import ScheduledBatch

# On CPU a step's tokens run through the layers in groups of about this many: activations that
# stay in cache (and allocations small enough to be reused) make a group of 1024 tokens ~15 %
# cheaper per token than one pass over an 8192-token step (measured: bench.embeddings).
CPU_GROUP_TOKENS = 1024

# Queries per SDPA call (pieces end at multiples of it in prompt positions, so that a prompt's
# pieces are the same whether it starts at 0 or continues from cached blocks): 32 rows run CPU
# SDPA's flash kernel 1.3-1.6x faster than whole sequences of 128-512 tokens (float32, one thread).
QUERY_PIECE = 32
MIN_QUERY_ROWS = 4  # see _sdpa

# The fewest rows a GEMM runs on (padded below it with rows nothing reads): see the module's docstring.
MIN_GEMM_ROWS = 16

# Pooled rows only past the last layer's attention (batch-invariant: MIN_GEMM_ROWS).
PRUNE_LAST_LAYER = True

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = (
    "layer",
    "qkv_proj",
    "split_qkv",
    "o_proj",
    "ops",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "q_size",
    "scale",
)
_MLP_PARTS = ("gate_up_proj", "down_proj", "ops")


def supports(model) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return False
    if not getattr(model, "plain_llama", True):  # a family's own blocks (windows, sandwich norms, ...)
        return False
    return (
        all(hasattr(layer, p) for layer in layers for p in _LAYER_PARTS)
        and all(hasattr(layer.self_attn, p) for layer in layers for p in _ATTN_PARTS)
        and all(hasattr(layer.mlp, p) for layer in layers for p in _MLP_PARTS)
    )


def applies(runner, batch: ScheduledBatch) -> bool:
    """Every sequence of the step pools (nothing samples, nothing decodes), on CPU: on a GPU the
    paged Triton kernels read the cache without a gather and one launch serves every sequence,
    where this path makes one SDPA call per sequence (not measured there; kept off)."""
    return (
        torch.device(runner.device).type == "cpu"
        and all(s.pooling is not None for s in batch.seqs)
        and supports(runner.model)
    )


def run(runner, batch: ScheduledBatch) -> None:
    """The step's forward pass; folds each sequence's rows into its pooling state."""
    input_ids, inputs, _ = runner.prepare(batch)
    write_kv = runner.config.enable_prefix_caching or any(
        s.num_computed_tokens + n < len(s) for s, n in zip(batch.seqs, batch.num_new_tokens)
    )
    with torch.no_grad():
        for seqs, counts, first in _groups(batch, CPU_GROUP_TOKENS):
            rows = slice(first, first + sum(counts))
            group_inputs = replace(inputs, positions=inputs.positions[rows], slot_mapping=inputs.slot_mapping[rows])
            spans, keep, row = [], [], 0
            for seq, n in zip(seqs, counts):
                start = seq.num_computed_tokens
                kept = seq.pooling.needed_rows(start, n, len(seq))
                spans.append(_Span(row, n, kept, start, seq.block_table))
                keep.extend(range(row + kept.start, row + kept.stop))
                row += n
            hidden = _forward(runner.model, input_ids[rows], group_inputs, spans, keep, write_kv)
            out = 0
            for seq, span in zip(seqs, spans):
                kept = span.kept.stop - span.kept.start
                seq.pooling.absorb_rows(hidden[out : out + kept], span.start, span.n, len(seq))
                out += kept


def _groups(batch: ScheduledBatch, group_tokens: int):
    """(sequences, their new-token counts, first row) of consecutive whole sequences of about
    `group_tokens` tokens each (a longer chunk alone)."""
    seqs, counts, first, row = [], [], 0, 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if counts and sum(counts) + n > group_tokens:
            yield seqs, counts, first
            seqs, counts, first = [], [], row
        seqs.append(seq)
        counts.append(n)
        row += n
    if seqs:
        yield seqs, counts, first


def _padded(rows: int) -> int:
    return max(rows, MIN_GEMM_ROWS)


def _forward(model, input_ids, inputs, spans, keep: list[int], write_kv: bool) -> torch.Tensor:
    """Final hidden states of the kept rows, in batch order."""
    inner = model.model
    tokens = input_ids.shape[0]
    positions = inputs.positions
    if _padded(tokens) > tokens:  # a tiny group: zero rows (token 0 at position 0) that nothing reads
        pad = _padded(tokens) - tokens
        input_ids = F.pad(input_ids, (0, pad))
        positions = F.pad(positions, (0, pad))
    x = inner.embed_tokens(input_ids)
    residual = None
    last = len(inner.layers) - 1
    masks: dict[tuple[int, int], torch.Tensor] = {}
    prune = None
    if PRUNE_LAST_LAYER and len(keep) < tokens:
        prune = torch.tensor(keep + [0] * (_padded(len(keep)) - len(keep)), dtype=torch.long, device=x.device)
    for i, layer in enumerate(inner.layers):
        if residual is None:
            residual, x = x, layer.input_layernorm(x)
        else:
            x, residual = layer.input_layernorm(x, residual)
        pruned = prune if i == last else None
        x = _attention(layer.self_attn, x, model.cos_sin, positions, inputs, spans, pruned, write_kv, masks)
        if pruned is not None:
            residual = residual[pruned]
        x, residual = layer.post_attention_layernorm(x, residual)
        mlp = layer.mlp
        x = mlp.down_proj(mlp.ops.silu_and_mul(mlp.gate_up_proj(x)))
    x, _ = inner.norm(x, residual)
    if prune is not None:
        return x[: len(keep)]
    return x[keep] if len(keep) < x.shape[0] else x


def _attention(attn, x, cos_sin, positions, inputs, spans, pruned, write_kv: bool, masks: dict) -> torch.Tensor:
    """o_proj of the attention of every row of `x`, or (`pruned`: the kept rows' indices, padded)
    of the kept rows only, with zero rows for the padding."""
    q, k, v = attn.split_qkv(attn.qkv_proj(x), positions, cos_sin)
    tokens = inputs.slot_mapping.shape[0]  # the real rows; those past them are padding
    if write_kv:
        k_cache, v_cache = inputs.kv_caches[attn.layer]
        attn.ops.write_kv_cache(k[:tokens], v[:tokens], k_cache, v_cache, inputs.slot_mapping)
    rows = x.shape[0] if pruned is None else pruned.shape[0]
    out = q.new_zeros((rows, attn.num_heads, attn.head_dim))
    gqa = attn.num_heads != attn.num_kv_heads
    done = 0
    for span in spans:
        first, start = span.first, span.start
        a, b = (0, span.n) if pruned is None else (span.kept.start, span.kept.stop)
        if a == b:
            continue
        # the queries at chunk rows [a, b) see the prompt's positions [0, start + b) causally
        ks, vs = k[first : first + b], v[first : first + b]
        if start:
            ks = torch.cat((_cached(inputs.kv_caches[attn.layer][0], span), ks))
            vs = torch.cat((_cached(inputs.kv_caches[attn.layer][1], span), vs))
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        p = a
        while p < b:  # pieces end at multiples of QUERY_PIECE prompt positions
            pe = min(b, (start + p) // QUERY_PIECE * QUERY_PIECE + QUERY_PIECE - start)
            qs = q[first + p : first + pe].transpose(0, 1).unsqueeze(0)
            keys = start + pe
            o = _sdpa(qs, ks[:, :, :keys], vs[:, :, :keys], attn.scale, gqa, masks)
            out[done : done + pe - p] = o[0].transpose(0, 1)
            done += pe - p
            p = pe
    return attn.o_proj(out.reshape(rows, attn.q_size))


def _sdpa(qs, ks, vs, scale: float, gqa: bool, masks: dict) -> torch.Tensor:
    """Attention of queries [1, heads, q, dim] at the last q of the keys' positions, causally. With
    fewer than MIN_QUERY_ROWS queries the last is repeated up to it: with 1 or 3, CPU SDPA takes a
    path whose result depends on the thread count (the worker's and the offline engine's differ)."""
    q_len, keys = qs.shape[2], ks.shape[2]
    rows = max(q_len, MIN_QUERY_ROWS)
    if rows > q_len:
        qs = torch.cat((qs, qs[:, :, -1:].expand(-1, -1, rows - q_len, -1)), dim=2)
    mask = masks.get((q_len, keys))
    if mask is None:
        mask = masks[q_len, keys] = _bottom_right_causal(q_len, keys, rows, qs.dtype, qs.device)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)[:, :, :q_len]


@dataclass(frozen=True)
class _Span:
    first: int  # the sequence's first row in the step's packed tokens
    n: int  # its new tokens
    kept: slice  # the rows of its chunk that pooling reads (all that pass the last layer)
    start: int  # prompt positions already computed (in the cache)
    block_table: list[int]


def _cached(cache: torch.Tensor, span: _Span) -> torch.Tensor:
    """[span.start, kv_heads, head_dim]: the cached positions [0, start) of the span's sequence."""
    block_size = cache.shape[1]
    blocks = torch.tensor(span.block_table[: -(-span.start // block_size)], dtype=torch.long, device=cache.device)
    return cache.index_select(0, blocks).flatten(0, 1)[: span.start]


def _bottom_right_causal(q_len: int, length: int, rows: int, dtype, device) -> torch.Tensor:
    """[1, 1, rows, length] additive mask: query i < q_len (position length - q_len + i) sees keys
    <= it, the rows past q_len (repeats of the last query) as the last. 4-D and additive, which
    keeps CPU SDPA on its flash kernel."""
    q_pos = torch.arange(length - q_len, length - q_len + rows, device=device).clamp_(max=length - 1)
    keep = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[None, None]
