"""Bidirectional attention over packed sequences: a step's inputs are laid end to end (no padding)
and each attends to itself only. Sequences of one length share one SDPA call (batched), so a step
of many short inputs makes a few calls, not one per input; a sliding window (ModernBERT's local
layers) is a band mask on the sequences longer than it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PackedBatch:
    """The layout of a step's packed tokens: `lengths[i]` tokens of sequence i from `starts[i]`."""

    lengths: list[int]
    starts: list[int] = field(init=False)
    groups: dict[int, torch.Tensor | int] = field(init=False)  # length -> row index [n, length], or a start
    _masks: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.starts, row = [], 0
        by_length: dict[int, list[int]] = {}
        for n in self.lengths:
            self.starts.append(row)
            by_length.setdefault(n, []).append(row)
            row += n
        self.groups = {}
        for n, starts in by_length.items():
            if len(starts) == 1:
                self.groups[n] = starts[0]
            else:
                self.groups[n] = (torch.tensor(starts)[:, None] + torch.arange(n)[None, :])

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def band(self, n: int, window: int, device) -> torch.Tensor:
        """[n, n] boolean: |query - key| <= window."""
        key = (n, window)
        if key not in self._masks:
            pos = torch.arange(n, device=device)
            self._masks[key] = (pos[:, None] - pos[None, :]).abs() <= window
        return self._masks[key]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
    tokens, heads, dim = q.shape
    out = q.new_empty((tokens, heads, dim))
    for n, rows in batch.groups.items():
        mask = batch.band(n, window, q.device) if window is not None and n - 1 > window else None
        if isinstance(rows, int):
            sl = slice(rows, rows + n)
            o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                               attn_mask=mask, scale=scale)
            out[sl] = o.transpose(0, 1)
        else:
            flat = rows.reshape(-1).to(q.device)
            qs, ks, vs = (t.index_select(0, flat).view(rows.shape[0], n, heads, dim).transpose(1, 2)
                          for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out.index_copy_(0, flat, o.transpose(1, 2).reshape(-1, heads, dim))
    return out.view(tokens, heads * dim)


def activation(name: str):
    """transformers' ACT2FN entries that encoders use."""
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")
