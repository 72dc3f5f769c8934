"""A leaner forward pass for CPU steps made only of pooling prompts.

Each sequence's attention runs on the K/V just computed (one SDPA call per sequence) instead of
gathering them back from the paged cache; only a chunk that continues a prompt (chunked prefill,
or a prefix-cache hit) reads its earlier positions from the cache. The cache is written only when
something will read it (prefix caching on, or a prompt that continues in a later chunk).

The step runs in groups of whole sequences of about `CPU_GROUP_TOKENS` tokens.

With `PRUNE_LAST_LAYER` (off by default: see there), in the last layer only the rows that pooling
reads go on past attention (the last token for last-token pooling, the first for CLS, all for
mean): the other rows' o_proj, MLP and final norm are skipped, their K/V still serve the kept
rows' attention.

The layers' own modules (projections, norms, rotary, MLP) do the work, in the order of
`engine.models.llama`; a model without that structure takes the generic path (`supports`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.scheduler import ScheduledBatch

# On CPU a step's tokens run through the layers in groups of about this many: activations that
# stay in cache (and allocations small enough to be reused) make a group of 1024 tokens ~15 %
# cheaper per token than one pass over an 8192-token step (measured: bench.embeddings).
CPU_GROUP_TOKENS = 1024

# Off: the last layer's GEMMs on a handful of pooled rows round differently from the same rows
# in a full GEMM, so a vector would depend on what it was batched with (the worker's and the
# offline engine's vectors must be bitwise equal: tests/test_platform_embeddings.py). On, it
# saves the last layer's o_proj and MLP for the other rows.
PRUNE_LAST_LAYER = False

_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTN_PARTS = ("layer", "project_qkv", "o_proj", "ops", "num_heads", "num_kv_heads", "head_dim", "q_size",
               "scale")


def supports(model) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return False
    return all(hasattr(layer, p) for layer in layers for p in _LAYER_PARTS) and all(
        hasattr(layer.self_attn, p) for layer in layers for p in _ATTN_PARTS)


def applies(runner, batch: ScheduledBatch) -> bool:
    """Every sequence of the step pools (nothing samples, nothing decodes), on CPU: on a GPU the
    paged Triton kernels read the cache without a gather and one launch serves every sequence,
    where this path makes one SDPA call per sequence (not measured there; kept off)."""
    return (torch.device(runner.device).type == "cpu" and all(s.pooling is not None for s in batch.seqs)
            and supports(runner.model))


def run(runner, batch: ScheduledBatch) -> None:
    """The step's forward pass; folds each sequence's rows into its pooling state."""
    input_ids, inputs, _ = runner.prepare(batch)
    write_kv = runner.config.enable_prefix_caching or any(
        s.num_computed_tokens + n < len(s) for s, n in zip(batch.seqs, batch.num_new_tokens))
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


def _forward(model, input_ids, inputs, spans, keep: list[int], write_kv: bool) -> torch.Tensor:
    """Final hidden states of the kept rows, in batch order."""
    inner = model.model
    x = inner.embed_tokens(input_ids)
    residual = None
    last = len(inner.layers) - 1
    keep_index = None
    if len(keep) < x.shape[0]:
        keep_index = torch.tensor(keep, dtype=torch.long, device=x.device)
    for i, layer in enumerate(inner.layers):
        if residual is None:
            residual, x = x, layer.input_layernorm(x)
        else:
            x, residual = layer.input_layernorm(x, residual)
        pruned = PRUNE_LAST_LAYER and i == last and keep_index is not None
        x = _attention(layer.self_attn, x, model.cos_sin, inputs, spans, keep_index if pruned else None, write_kv)
        if pruned:
            residual = residual[keep_index]
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
    x, _ = inner.norm(x, residual)
    return x if PRUNE_LAST_LAYER or keep_index is None else x[keep_index]


def _attention(attn, x, cos_sin, inputs, spans, keep_index, write_kv: bool) -> torch.Tensor:
    tokens = x.shape[0]
    q, k, v = attn.project_qkv(x, inputs.positions, cos_sin)
    if write_kv:
        k_cache, v_cache = inputs.kv_caches[attn.layer]
        attn.ops.write_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
    rows = tokens if keep_index is None else keep_index.shape[0]
    out = q.new_empty((rows, attn.num_heads, attn.head_dim))
    gqa = attn.num_heads != attn.num_kv_heads
    done = 0
    for span in spans:
        first, start = span.first, span.start
        a, b = (0, span.n) if keep_index is None else (span.kept.start, span.kept.stop)
        if a == b:
            continue
        # the queries at chunk rows [a, b) see the prompt's positions [0, start + b) causally
        qs = q[first + a : first + b].transpose(0, 1).unsqueeze(0)
        ks, vs = k[first : first + b], v[first : first + b]
        if start:
            ks = torch.cat((_cached(inputs.kv_caches[attn.layer][0], span), ks))
            vs = torch.cat((_cached(inputs.kv_caches[attn.layer][1], span), vs))
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        if b - a == 1:  # one query row: every key is before it
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=attn.scale, enable_gqa=gqa)
        elif start == 0 and a == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=attn.scale, enable_gqa=gqa)
        else:
            mask = _bottom_right_causal(b - a, start + b, qs.dtype, qs.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=attn.scale, enable_gqa=gqa)
        out[done : done + b - a] = o[0].transpose(0, 1)
        done += b - a
    return attn.o_proj(out.reshape(rows, attn.q_size))


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


def _bottom_right_causal(q_len: int, length: int, dtype, device) -> torch.Tensor:
    """[1, 1, q_len, length] additive mask: query i (position length - q_len + i) sees keys <= it.
    4-D and additive, which keeps CPU SDPA on its flash kernel."""
    q_pos = torch.arange(length - q_len, length, device=device)
    keep = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[None, None]
