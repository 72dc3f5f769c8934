"""Decode steps replayed from CUDA graphs.

A decode-only step (every sequence computes one token) is padded up to the next size of a
ladder of batch sizes. Its inputs are copied into static buffers, and the graph captured
for that size is replayed. Padding rows have slot -1 (their K/V is never written) and
context length 0 (their attention reads nothing and yields zeros); their outputs are
dropped. The same padded path can run eagerly, without capturing, on any device: that is
how CPU tests check its logic.

Attention inside a graph gets fixed host-side hints: decode-only, a context bound of
max_model_len, a static output buffer. The bound only sets how many partitions the
flash-decoding kernel may split a context into; each partition's length is computed on
the device from the sequence's real length, so short contexts leave the extra partitions
empty (a few idle programs) rather than doing worst-case work. One graph per batch size
therefore serves every context length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from engine.models.llama import AttentionInputs

log = logging.getLogger(__name__)

LADDER_MAX = 512


def batch_size_ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, then every 16 up to 256 and
    every 32 up to 512, cut at (and always ending with) max_batch."""
    max_batch = max(1, min(max_batch, LADDER_MAX))
    steps = [1, 2, 4, 8, 16, 24, 32, 48, *range(64, 256, 16), *range(256, LADDER_MAX + 1, 32)]
    return sorted({s for s in steps if s < max_batch} | {max_batch})


class DecodeGraphRunner:
    """Padded static-buffer decode steps, replayed from CUDA graphs once `capture()` ran."""

    def __init__(
        self,
        model,
        kv_caches,
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_hints: bool,
    ):
        cfg = model.cfg
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_size_ladder(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.attention_hints = attention_hints
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        width = -(-max_model_len // block_size)
        n = self.max_batch
        on_cuda = device.type == "cuda"

        def host(*shape, dtype=torch.long):  # staging, written through numpy views
            return torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)

        self._host = dict(
            input_ids=host(n),
            positions=host(n),
            slot_mapping=host(n),
            seq_lens=host(n, dtype=torch.int32),
            block_tables=host(n, width, dtype=torch.int32),
        )
        self._np = {k: t.numpy() for k, t in self._host.items()}
        self._buf = {k: torch.zeros_like(t, device=device) for k, t in self._host.items()}
        self._buf["slot_mapping"].fill_(-1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.attn_out = (
            torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device) if attention_hints else None
        )
        self._copied = torch.cuda.Event() if on_cuda else None  # staging may be rewritten after it
        self._table_rows: list[tuple[list | None, int]] = [(None, 0)] * n  # (table list, entries written)

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def can_run(self, num_new_tokens: Seq[int]) -> bool:
        """Decode-only (one new token per sequence) and no larger than the largest size."""
        return len(num_new_tokens) <= self.max_batch and all(n == 1 for n in num_new_tokens)

    def run(self, seqs, feed=None) -> torch.Tensor:
        """Hidden states [len(seqs), hidden] of a decode step, a view of a static buffer
        that the next step overwrites. `feed`: input ids taken from the step in flight."""
        size = self.padded_size(len(seqs))
        self._load(seqs, size)
        if feed is not None:
            feed.apply(self._buf["input_ids"])
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._forward(size)
        return self.hidden[: len(seqs)]

    def _load(self, seqs, size: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging buffers
        ids, pos, slots, lens, tables = (
            self._np[k] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        )
        n, bs = len(seqs), self.block_size
        computed = [s.num_computed_tokens for s in seqs]
        ids[:n] = [s.token_ids[p] for s, p in zip(seqs, computed)]
        pos[:n] = computed
        slots[:n] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, computed)]
        lens[:n] = [p + 1 for p in computed]
        ids[n:size] = pos[n:size] = lens[n:size] = 0
        slots[n:size] = -1
        # Block tables change little between steps: a row is rewritten only from where it last
        # stopped, while it holds the same table list. That relies on the BlockManager growing a
        # sequence's table in place and replacing (never editing) it when blocks are released.
        # Columns past a table keep old, valid block ids, which the kernels never read.
        rows = self._table_rows
        for i, seq in enumerate(seqs):
            table = seq.block_table
            held, written = rows[i]
            if held is not table:
                written = 0
            if len(table) > written:
                tables[i, written : len(table)] = table[written:]
                rows[i] = (table, len(table))
        for key, host in self._host.items():
            self._buf[key][:size].copy_(host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _forward(self, size: int) -> None:
        b = self._buf
        hints = {}
        if self.attention_hints:
            hints = dict(max_query_len=1, max_seq_len=self.max_model_len, attn_out=self.attn_out[:size])
        inputs = AttentionInputs(
            positions=b["positions"][:size],
            slot_mapping=b["slot_mapping"][:size],
            block_tables=b["block_tables"][:size],
            seq_lens=b["seq_lens"][:size],
            query_start_loc=self.query_start_loc[: size + 1],
            kv_caches=self.kv_caches,
            **hints,
        )
        self.hidden[:size] = self.model(b["input_ids"][:size], inputs)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one graph per ladder size, largest first, all sharing one memory pool.
        The static buffers hold padding only (slot -1, length 0), so nothing touches the KV cache."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # compiles this size's kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = pool if pool is not None else graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode graphs (batch 1..%d) in %.1fs, %.0f MiB",
            len(self.graphs),
            self.max_batch,
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )
