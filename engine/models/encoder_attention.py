"""Bidirectional attention over packed sequences: a step's inputs are laid end to end (no padding in
the linear layers) and each attends to itself only. Attention runs per bucket of similar lengths:
one SDPA call over the bucket's sequences padded to its longest, the padding keys masked, a bucket
closed when its padding would pass `BUCKET_WASTE` of its tokens. A step of many inputs thus makes a
few calls, not one per input (on a busy CPU each call's thread hand-off costs more than its padding).
A sliding window (ModernBERT's local layers) is a band mask on top."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.runner.cpu_linear import PackedLinear

BUCKET_WASTE = 0.25  # at most this share of a bucket's attention rows are padding


@dataclass
class _Bucket:
    length: int  # the longest sequence's
    count: int
    gather: torch.Tensor | None  # [count * length] rows of the packed tokens (padding: row 0); None: one sequence
    start: int  # one sequence: its first row
    scatter: torch.Tensor | None  # where each of the [count * length] rows goes in the output (padding: a spare row)
    key_mask: torch.Tensor | None  # [count, 1, 1, length] boolean: a real key


@dataclass
class PackedBatch:
    """The layout of a step's packed tokens: `lengths[i]` tokens of sequence i from `starts[i]`."""

    lengths: list[int]
    starts: list[int] = field(init=False)
    buckets: list[_Bucket] = field(init=False)
    _masks: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        self.starts, row = [], 0
        for n in self.lengths:
            self.starts.append(row)
            row += n
        order = sorted(range(len(self.lengths)), key=lambda i: -self.lengths[i])
        self.buckets, group = [], []
        for i in order:
            n = self.lengths[i]
            if group:
                longest = self.lengths[group[0]]
                real = sum(self.lengths[j] for j in group) + n
                if longest * (len(group) + 1) > real * (1 + BUCKET_WASTE):
                    self.buckets.append(self._bucket(group))
                    group = []
            group.append(i)
        if group:
            self.buckets.append(self._bucket(group))

    def _bucket(self, group: list[int]) -> _Bucket:
        length = self.lengths[group[0]]
        if len(group) == 1:
            return _Bucket(length, 1, None, self.starts[group[0]], None, None)
        offsets = torch.arange(length)
        lengths = torch.tensor([self.lengths[i] for i in group])
        starts = torch.tensor([self.starts[i] for i in group])
        real = offsets[None, :] < lengths[:, None]
        gather = torch.where(real, starts[:, None] + offsets[None, :], 0).reshape(-1)
        scatter = torch.where(real, starts[:, None] + offsets[None, :], self.num_tokens).reshape(-1)
        key_mask = None if bool(real.all()) else real[:, None, None, :]
        return _Bucket(length, len(group), gather, 0, scatter, key_mask)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def band(self, n: int, window: int, device) -> torch.Tensor:
        """[n, n] boolean: |query - key| <= window."""
        key = (n, window, device)
        if key not in self._masks:
            pos = torch.arange(n, device=device)
            self._masks[key] = (pos[:, None] - pos[None, :]).abs() <= window
        return self._masks[key]

    def to(self, device) -> PackedBatch:
        for b in self.buckets:
            if b.gather is not None:
                b.gather, b.scatter = b.gather.to(device), b.scatter.to(device)
                b.key_mask = None if b.key_mask is None else b.key_mask.to(device)
        return self


def packed_attention(
    qkv: torch.Tensor, batch: PackedBatch, scale: float, window: int | None = None, rotate=None
) -> torch.Tensor:
    """qkv: [tokens, 3, heads, head_dim] -> [tokens, heads * head_dim]. `rotate(q, k)`: rotary
    positions applied to the packed queries and keys first."""
    tokens, _, heads, dim = qkv.shape
    q, k, v = qkv.unbind(1)
    if rotate is not None:
        q, k = rotate(q, k)
        qkv = torch.stack((q, k, v), dim=1)
    out = q.new_empty((tokens + 1, heads, dim))  # the last row: where padding rows' outputs are dropped
    for b in batch.buckets:
        n = b.length
        band = batch.band(n, window, q.device) if window is not None and n - 1 > window else None
        if b.gather is None:
            sl = slice(b.start, b.start + n)
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],
                k[sl].transpose(0, 1)[None],
                v[sl].transpose(0, 1)[None],
                attn_mask=band,
                scale=scale,
            )
            out[sl] = o[0].transpose(0, 1)
            continue
        rows = qkv.reshape(tokens, 3 * heads * dim).index_select(0, b.gather)
        qs, ks, vs = rows.view(b.count, n, 3, heads, dim).transpose(1, 3).unbind(2)
        mask = b.key_mask
        if band is not None:
            mask = band if mask is None else mask & band
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out.index_copy_(0, b.scatter, o.transpose(1, 2).reshape(b.count * n, heads, dim))
    return out[:tokens].view(tokens, heads * dim)


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


_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # activation -> F.gelu's approximate


def dense_act(linear, x: torch.Tensor, name: str) -> torch.Tensor:
    """`activation(name)(linear(x))`; a GELU after a oneDNN-packed layer runs inside its GEMM."""
    if isinstance(linear, PackedLinear) and name in _GELU:
        return linear.forward_gelu(x, _GELU[name])
    return activation(name)(linear(x))


def dense_add(linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x)`; after a oneDNN-packed layer the sum runs inside its GEMM."""
    if isinstance(linear, PackedLinear):
        return linear.forward_add(x, residual)
    return residual + linear(x)
