"""`prompt_logprobs`: each prompt token's logprob given the tokens before it, from the same
forward passes as the prefill, chunk by chunk. A chunk's hidden state at position p predicts
prompt token p + 1. Positions already recorded (before a preemption) are not recorded twice.
As in vLLM, such requests do not read the prefix cache (a cached block has no logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.runner.device import fetch, to_device
from engine.sampling.sampler import SampleLogprobs

# Rows turned into full-vocabulary logits at a time, so a long prefill chunk stays within memory.
_ROWS_PER_SLICE = 256


@dataclass
class _Span:
    seq: Sequence
    first_position: int  # the first chunk position whose prediction is recorded
    count: int


def plan(batch: ScheduledBatch) -> tuple[list[_Span], list[int]]:
    """The spans of this batch that owe prompt logprobs, and their rows in the flattened batch."""
    spans, rows, offset = [], [], 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            first = max(start, len(seq.prompt_logprobs) - 1)  # entry i is prompt token i; 0 is None
            last = min(start + n, seq.num_prompt_tokens - 1)  # position p predicts token p + 1
            if first < last:
                spans.append(_Span(seq, first, last - first))
                rows.extend(range(offset + first - start, offset + last - start))
        offset += n
    return spans, rows


@torch.no_grad()
def record(spans: list[_Span], hidden: torch.Tensor, compute_logits, vocab_size: int, to_entry) -> None:
    """Append each span's entries to its seq's `prompt_logprobs` (`to_entry` turns a
    SampleLogprobs into the output dict)."""
    targets, counts = [], []
    for span in spans:
        p = span.first_position
        targets.extend(span.seq.token_ids[p + 1 : p + 1 + span.count])
        want = span.seq.params.prompt_logprobs
        counts.extend([vocab_size if want == -1 else want] * span.count)
    results = []
    for lo in range(0, len(targets), _ROWS_PER_SLICE):
        hi = min(lo + _ROWS_PER_SLICE, len(targets))
        results.extend(_slice(compute_logits(hidden[lo:hi]), targets[lo:hi], counts[lo:hi]))
    row = 0
    for span in spans:
        span.seq.prompt_logprobs.extend(to_entry(span.seq, r) for r in results[row : row + span.count])
        row += span.count


def _slice(logits: torch.Tensor, targets: list[int], counts: list[int]) -> list[SampleLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = to_device(targets, torch.long, logprobs.device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = (logprobs >= chosen).sum(dim=-1)
    k = min(max(counts), logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k else None
    lists = fetch(chosen.squeeze(1), ranks, *((top.values, top.indices) if top is not None else ()))
    out = []
    for j, (token, n) in enumerate(zip(targets, counts)):
        ids, values = (lists[3][j][:n], lists[2][j][:n]) if n else ([], [])
        out.append(SampleLogprobs(token, lists[0][j], lists[1][j], ids, values))
    return out
