"""Gemma 3's image tokens attend to each other both ways within one image, as transformers masks them
(full layers: causal OR same image; sliding layers: that AND inside the window). The paged kernels are
causal, so the rows of each image are attended again here over the keys up to the image's end, read
from the paged cache (the step wrote them). The scheduler never ends a chunk inside such an image
(`whole_image_chunk`), so every key the image's rows need is in the cache when they run."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def whole_image_chunk(seq, start: int, n: int) -> int:
    """`n` tokens from `start`, cut so that the chunk does not end inside an image (0: wait for budget)."""
    end = start + n
    for item in seq.mm.images:
        lo, hi = item.offset, item.offset + item.length
        if lo < end < hi:
            return max(lo - start, 0)
    return n


@dataclass
class ImageSpan:
    rows: torch.Tensor  # the step's flat rows of the image's tokens computed now
    query_positions: torch.Tensor
    key_slots: torch.Tensor  # cache slots of positions [0, image end)
    key_positions: torch.Tensor
    image_start: int
    image_end: int


def image_spans(seqs, num_new_tokens, block_size: int, device) -> list[ImageSpan]:
    spans, offset = [], 0
    for seq, n in zip(seqs, num_new_tokens):
        start = seq.num_computed_tokens
        for item, _first, pos, count in seq.mm.overlapping(start, start + n) if seq.mm is not None else ():
            end = item.offset + item.length
            keys = torch.arange(end)
            table = torch.tensor(seq.block_table[: (end + block_size - 1) // block_size])
            slots = table[keys // block_size] * block_size + keys % block_size
            row0 = offset + pos - start
            spans.append(
                ImageSpan(
                    torch.arange(row0, row0 + count, device=device),
                    torch.arange(pos, pos + count, device=device),
                    slots.to(device),
                    keys.to(device),
                    item.offset,
                    end,
                )
            )
        offset += n
    return spans


def attend_within_images(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spans: list[ImageSpan],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """`out` [T, H, D] with each image row's attention redone under the bidirectional-image mask."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    flat_k = k_cache.view(-1, kv_heads, k_cache.shape[-1])
    flat_v = v_cache.view(-1, kv_heads, v_cache.shape[-1])
    out = out.clone()
    for span in spans:
        k = flat_k[span.key_slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [K, H, D]
        v = flat_v[span.key_slots].float().repeat_interleave(heads // kv_heads, dim=1)
        qs = q[span.rows].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qp, kp = span.query_positions[:, None], span.key_positions[None, :]
        allowed = (kp <= qp) | ((kp >= span.image_start) & (kp < span.image_end))
        if window:
            allowed &= qp - kp < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[span.rows] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
