"""Decides, every step, which sequences run and how many tokens each computes.

One rule covers prefill and decode alike: a scheduled sequence computes the tokens it
has that are not yet in the KV cache, capped by what is left of the step's token
budget. A long prompt thus runs in chunks that share steps with decodes. Running
sequences go first, oldest first; waiting ones join in arrival order while the budget,
the sequence cap and the pool allow. When the pool runs dry the newest running
sequence is preempted: its blocks are freed and it is recomputed later. Sequences of the
requests in `paused` (set by the caller) are skipped: they keep their blocks and wait. With LoRA, a
step's sequences are grouped by adapter.

vLLM's `scheduling_policy="priority"` replaces arrival order with rank: (priority, arrival), a
lower priority value first. Both queues are kept in rank order, so waiting sequences join best
first, running ones get the budget best first, and the one preempted is the worst ranked.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence, SequenceStatus
from engine.multimodal.bidirectional import whole_image_chunk


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def chunk_size(seq: Sequence, start: int, n: int) -> int:
    """`n`, or less where a chunk may not end inside an image (engine.multimodal.bidirectional)."""
    return whole_image_chunk(seq, start, n) if seq.mm is not None and seq.mm.whole_images else n


def rank(seq: Sequence) -> tuple:
    """Under the priority policy: a lower priority value first, then the earlier arrival."""
    return seq.priority, seq.arrival, seq.seq_id


def _group_by_adapter(batch: ScheduledBatch) -> None:
    """Order the batch's sequences by adapter (stable): each adapter's rows then form one run, which the
    CPU LoRA layers multiply by that adapter's weights alone (engine/lora/layers.py). A batch's order
    changes nothing else: every output is per sequence, and sequences sharing prefix blocks share one
    adapter, so keep their order."""
    order = sorted(range(len(batch.seqs)), key=lambda i: batch.seqs[i].lora_id)
    batch.seqs[:] = [batch.seqs[i] for i in order]
    batch.num_new_tokens[:] = [batch.num_new_tokens[i] for i in order]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", whole_prompts: bool = False, max_loras: int | None = None):  # fmt: skip
        self.block_manager = block_manager
        self.whole_prompts = whole_prompts  # an encoder's inputs: never split into chunks
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.paused: frozenset[str] = frozenset()  # request ids not to schedule for now
        self.max_loras = max_loras  # most LoRA adapters among the running sequences (vLLM's max_loras)

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=rank)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        blocks, block_size, paused = self.block_manager, self.block_manager.block_size, self.paused
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if paused and seq.request_id in paused:
                i += 1
                continue
            end = seq.num_computed_tokens + min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if end == seq.num_computed_tokens:  # its last token is being sampled (engine.core.async_steps)
                i += 1
                continue
            if seq.mm is not None:
                end = seq.num_computed_tokens + chunk_size(seq, seq.num_computed_tokens, end - seq.num_computed_tokens)
                if end == seq.num_computed_tokens:  # its next image needs more of the budget than is left
                    i += 1
                    continue
            if blocks.window is not None:
                blocks.drop_behind_window(seq)
            if end > len(seq.block_table) * block_size:  # else its table already holds the tokens
                while not blocks.grow(seq, end):
                    preempted = True
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break
            n = end - seq.num_computed_tokens
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            if end // block_size > seq.num_registered_blocks:  # a block fills up in this step
                blocks.register_full_blocks(seq, end)
            budget -= n
            i += 1
        # Admit no one in a step that had to preempt: the pool is already too tight.
        skipped: list[Sequence] = []
        adapters = {s.lora_id for s in self.running if s.lora_id} if self.max_loras else set()
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.request_id in self.paused or (
                self.max_loras and seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras
            ):
                skipped.append(self.waiting.popleft())  # paused, or its adapter waits for a free slot (vLLM)
                continue
            hits = self.block_manager.match_prefix(seq)
            computed = len(hits) * self.block_manager.block_size
            n = chunk_size(seq, computed, min(len(seq) - computed, budget))
            if n == 0 or (self.whole_prompts and n < len(seq) - computed):
                break
            if not self.block_manager.can_hold(seq, computed + n, hits):
                break
            self.block_manager.take_prefix(seq, hits)
            self.block_manager.grow(seq, computed + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.lora_id:
                adapters.add(seq.lora_id)
            if self.by_priority:
                bisect.insort(self.running, seq, key=rank)
            else:
                self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            self.block_manager.register_full_blocks(seq, computed + n)  # later admissions may share them
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if self.max_loras and len({s.lora_id for s in batch.seqs}) > 1:
            _group_by_adapter(batch)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=rank)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.FINISHED
