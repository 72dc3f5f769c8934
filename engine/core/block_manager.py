"""The paged KV pool: fixed-size blocks, reference counts, a free list, and prefix caching.

A full block is identified by a chained hash: sha256(parent block's hash + its token ids),
so equal hashes mean equal whole prefixes. A freed block keeps its hash and stays
findable until it is handed out again; the free list is ordered so that the least
recently freed blocks are reused first.

Where every layer of the model attends to a sliding window (Mistral v0.1's config), the blocks that
fell wholly behind the window are released as a sequence moves on (`drop_behind_window`; with prefix
caching they stay findable until reused), so a long sequence holds about window / block_size blocks,
as vLLM's hybrid allocator does. Their ids stay in the block table, never read: the attention kernels
start at the first block a window reaches. A model with any full-attention layer (Gemma 2/3's global
layers) needs every block, and nothing is released early.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engine.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def first_parent(lora_id: int) -> bytes:
    """The parent of a sequence's first block: the adapter is part of every block's identity, so that
    blocks computed under one LoRA adapter (or the base model) are never shared with another."""
    return b"lora:%d" % lora_id if lora_id else b""


def chain_hash(parent: bytes, tokens) -> bytes:
    """A full block's identity: its parent block's hash and its own token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def model_window(model_config) -> int | None:
    """The widest sliding window of a model whose every layer has one (blocks behind it can go), else None."""
    windows = getattr(model_config, "layer_windows", ())
    return max(windows) if windows and all(windows) else None


def slides(seq: Sequence) -> bool:
    """Whether only attention reads `seq`'s past KV: not a pooling request's (its pooled positions) or an
    exported prompt's. (Images read it again only in Gemma 3, whose global layers keep every block.)"""
    extra = getattr(seq.params, "extra_args", None)
    return seq.pooling is None and not (extra and "kv_transfer_params" in extra)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None):
        """`window`: the widest sliding window of a model whose every layer has one; None keeps every block."""
        self.window = window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_used = 0  # blocks [0, num_used) have been handed out at least once (fresh ones go in order)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Hash of the seq's full block `index`, memoised on the sequence."""
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            root = first_parent(seq.lora_id) + (seq.mm.salt if seq.mm is not None else b"")
            parent = seq.block_hashes[i - 1] if i else root
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            seq.block_hashes.append(chain_hash(parent, tokens))
        return seq.block_hashes[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of `seq`, always leaving at least
        one token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # as vLLM: a cached prefix has no logits, so prompt_logprobs recompute it
        if seq.pooling is not None and seq.pooling.needs_every_token:
            return []  # mean/CLS pooling read every token's hidden state, which a hit would skip
        hits = []
        for i in range(len(seq) // self.block_size):
            block = self.cached.get(self.block_hash(seq, i))
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= len(seq):
            hits.pop()
        return hits

    def num_cached_blocks(self, token_ids: list[int], lora_id: int = 0) -> int:
        """How many leading full blocks of `token_ids` (under adapter `lora_id`) the prefix cache holds now."""
        if not self.enable_prefix_caching:
            return 0
        parent, bs = first_parent(lora_id), self.block_size
        for i in range(len(token_ids) // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            if parent not in self.cached:
                return i
        return len(token_ids) // bs

    def blocks_needed(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> int:
        """Free blocks consumed if `seq` (with prefix `hits`) must hold `num_tokens` tokens."""
        revived = sum(1 for b in hits[self.behind(seq, len(hits) * self.block_size) :] if self.ref_counts[b] == 0)
        have = len(seq.block_table) or len(hits)
        return revived + max(0, cdiv(num_tokens, self.block_size) - have)

    def can_hold(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        return self.blocks_needed(seq, num_tokens, hits) <= len(self.free)

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give a fresh sequence the cached blocks of its prefix (shared, not copied)."""
        assert not seq.block_table
        behind = self.behind(seq, len(hits) * self.block_size)  # hits a window no longer reaches: not taken
        for block in hits[behind:]:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_dropped_blocks = behind
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if not seq.num_preemptions:  # as vLLM: the hits of its first admission; a recomputation saves nothing new
            seq.num_cached_tokens = seq.num_computed_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table hold `num_tokens` tokens; False if the pool is too dry."""
        need = cdiv(num_tokens, self.block_size) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._allocate())
        return True

    def _allocate(self) -> int:
        """The least recently freed block, forgotten by the prefix cache, held once."""
        block, _ = self.free.popitem(last=False)
        if block >= self.num_used:
            self.num_used = block + 1
        old = self.block_hashes[block]
        if old is not None:
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (a `parent.fork()`) the parent's computed KV: full blocks shared by
        reference count, a last partial block copied on write into a fresh block. Returns
        (parent's block, the copy) for the caller to copy on the device, or None when nothing
        is to copy. With no free block the child keeps only the full blocks and recomputes
        the partial one's tokens (never more than block_size - 1)."""
        bs = self.block_size
        full, partial = divmod(parent.num_computed_tokens, bs)
        shared = parent.block_table[:full]
        child.num_dropped_blocks = min(parent.num_dropped_blocks, full)
        for block in shared[child.num_dropped_blocks :]:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        if not partial:
            return None
        if not self.free:
            child.num_computed_tokens = full * bs
            return None
        copy = self._allocate()
        child.block_table.append(copy)
        return parent.block_table[full], copy

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks; the tail goes back first so that prefixes,
        which other requests are likelier to share, are evicted last."""
        for block in reversed(seq.block_table[seq.num_dropped_blocks :]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_dropped_blocks = 0
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def sliding(self, params, budget: int) -> tuple[int, int] | None:
        """(window, a step's token budget) for `request_checks.check_fits` where a request with `params`
        holds only its window's blocks; None where it holds them all (an exported prompt reads them)."""
        extra = getattr(params, "extra_args", None)
        return None if self.window is None or (extra and "kv_transfer_params" in extra) else (self.window, budget)

    def behind(self, seq: Sequence, computed: int) -> int:
        """How many leading blocks the window of `seq`'s next token (after `computed`) no longer reaches."""
        if self.window is None or not slides(seq):
            return 0
        return max(0, computed - self.window + 1) // self.block_size

    def drop_behind_window(self, seq: Sequence) -> None:
        """Release `seq`'s blocks wholly behind the window of its next token (at num_computed_tokens, it
        sees from num_computed_tokens - window + 1 on), where the model's every layer is windowed.
        With prefix caching only registered blocks go (a later registration must not name a reused
        one); sequences that read their whole context otherwise (pooling, a KV export) keep it."""
        behind = self.behind(seq, seq.num_computed_tokens)
        if self.enable_prefix_caching:
            behind = min(behind, seq.num_registered_blocks)
        for block in seq.block_table[seq.num_dropped_blocks : behind]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, behind)

    def register_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Make the seq's newly completed blocks findable by their hash: those computed, or
        with `num_tokens`, those the step being scheduled computes (each layer writes the whole
        step's K/V before any attention reads it, so a sequence admitted later in the same step
        may already share them)."""
        if not self.enable_prefix_caching:
            return
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(num_tokens, len(seq.token_ids) - seq.num_pending) // self.block_size  # placeholders: later
        for i in range(seq.num_registered_blocks, num_full):
            block = seq.block_table[i]
            if self.block_hashes[block] is not None:
                continue
            h = self.block_hash(seq, i)
            if h not in self.cached:
                self.cached[h] = block
                self.block_hashes[block] = h
        seq.num_registered_blocks = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM does: only when no block is in use (False otherwise)."""
        if any(self.ref_counts):
            return False
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        return True
