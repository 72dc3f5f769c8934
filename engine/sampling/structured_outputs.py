"""Structured outputs in the engine: one xgrammar matcher per sequence, masks for the whole batch.

The engine asks `StructuredOutputs.start` for a request's compiled grammar (a future; the request
waits in the intake queue until it is ready, never blocking a step), `attach`es a matcher to each
of its sequences, and after each sampled token `advance`s the matcher. The sampler calls
`apply_grammar_bitmask` once per step: every constrained row's allowed tokens are filled into one
bitmask (in parallel, by xgrammar's batch matcher) and applied to the logits in one call, on the
CPU or the GPU. The EOS ids are the grammar's stop tokens, so EOS is allowed only once the grammar
accepts. A preempted sequence keeps its tokens (it is recomputed), so its matcher stays valid.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from engine.core.sequence import Sequence
from engine.params.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.sampling.grammar_cache import GrammarCache

# xgrammar (which imports transformers: over a second) is imported by the first constrained request, not
# by the engine's start: most jobs have none.

log = logging.getLogger(__name__)

_local = threading.local()  # one batch matcher per stepping thread


class StructuredOutputs:
    """The engine's structured-output state: a grammar cache made on the first constrained request."""

    def __init__(
        self,
        tokenizer_loader,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_entries: int = 256,
        *,
        threads: int = 2,
    ):
        """`tokenizer_loader()`: transformers' tokenizer (xgrammar reads its vocabulary), called by the first
        constrained request."""
        self._loader = tokenizer_loader
        self._args = (vocab_size, stop_token_ids)
        self._options = {"max_entries": cache_entries, "threads": threads}
        self._cache: GrammarCache | None = None

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            from engine.sampling.grammar_cache import GrammarCache

            self._cache = GrammarCache(self._loader(), *self._args, **self._options)
        return self._cache

    @staticmethod
    def check(spec: StructuredOutputsParams) -> None:
        from engine.sampling.grammar_cache import check_spec

        check_spec(spec)

    def start(self, spec: StructuredOutputsParams) -> Future:
        return self.cache.get(spec)

    @staticmethod
    def attach(seqs: list[Sequence], compiled: Future) -> None:
        import xgrammar as xgr

        grammar = compiled.result()
        for seq in seqs:
            seq.grammar = xgr.GrammarMatcher(grammar)
            # a preempted-and-rerun sequence never lost tokens; a fresh one has none to replay
            for token in seq.output_token_ids:
                seq.grammar.accept_token(token)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()


def advance(seq: Sequence, token: int) -> bool:
    """Feed the sampled token to the sequence's matcher; True when the grammar is complete."""
    matcher = seq.grammar
    if matcher is None:
        return False
    if not matcher.is_terminated() and not matcher.accept_token(token):
        # only min_tokens or ignore_eos can force a token the grammar did not allow
        log.warning("request %s: token %d breaks its grammar; constraint dropped", seq.request_id, token)
        seq.grammar = None
        return False
    return matcher.is_terminated()


def _buffers(rows: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's bitmask buffers (host, pinned for a GPU; and on the device), reused every step.
    Reusing the host buffer is safe: each step waits for its sampled tokens, after the copy."""
    words = (vocab_size + 31) // 32
    buffers = _local.__dict__.setdefault("buffers", {})
    host, on_device = buffers.get((device, words), (None, None))
    if host is None or host.shape[0] < rows:
        size = max(rows, 2 * (host.shape[0] if host is not None else 32))
        host = torch.empty(size, words, dtype=torch.int32, pin_memory=device.type == "cuda")
        on_device = host if device.type == "cpu" else torch.empty_like(host, device=device)
        buffers[(device, words)] = (host, on_device)
    return host[:rows], on_device[:rows]


def fill_grammar_bitmask(
    seqs: list[Sequence], vocab_size: int, bitmask: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]] | None:
    """(a bitmask with a row per sequence, the constrained rows filled), or None if no row is constrained."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.grammar.is_terminated()]
    if not rows:
        return None
    import xgrammar as xgr

    if bitmask is None:
        bitmask = xgr.allocate_token_bitmask(len(seqs), vocab_size)
    if len(rows) == 1:
        seqs[rows[0]].grammar.fill_next_token_bitmask(bitmask, rows[0])
    else:
        if getattr(_local, "matcher", None) is None:
            _local.matcher = xgr.BatchGrammarMatcher()
        _local.matcher.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], bitmask, rows)
    return bitmask, rows


def apply_grammar_bitmask(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Mask, in place, every token a constrained row's grammar does not allow next."""
    if not any(s.grammar is not None for s in seqs):
        return logits
    host, on_device = _buffers(len(seqs), logits.shape[-1], logits.device)
    filled = fill_grammar_bitmask(seqs, logits.shape[-1], host)
    if filled is None:
        return logits
    bitmask, rows = filled
    if logits.device.type != "cpu":
        bitmask = on_device.copy_(host, non_blocking=True)
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    return logits
