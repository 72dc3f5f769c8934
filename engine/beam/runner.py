"""Beam search run inside the engine: every live beam is a running `Sequence` on the paged cache.

A prompt is prefilled once. Each engine step then decodes every live beam by one token in one
batched forward and hands each beam's logprob entry to the search (`Sequence.on_logprobs`) instead
of appending a sampled token; a beam whose entry came in is parked (out of the scheduler, its
blocks kept) until all beams of its prompt have theirs. The search then picks the next beams
(`engine.beam.search.next_beams`): a beam not extended is freed at once; the first child of a beam
continues in its sequence, every other child forks it, sharing its full blocks by reference count
and copying the last partial block (copy-on-write, `ModelRunner.copy_blocks`). Nothing is computed
twice.

Memory: a prompt starts only when its worst case (every beam with its own blocks past the prompt's
full ones, at the longest) fits beside the prompts already running, so the search alone never runs
the pool dry and waits instead; a prompt whose worst case exceeds the whole pool is refused up front.
Should other requests crowd the pool anyway, the scheduler's preemption and a fork without a free
block fall back to recomputing (correct, only slower). The search holds the engine's lock throughout.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.beam.search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, best_sequences, next_beams
from engine.core.block_manager import cdiv
from engine.core.contract import SequenceEngine
from engine.core.sequence import Sequence, SequenceStatus
from engine.params.outputs import Logprob
from engine.params.sampling_params import SamplingParams


@dataclass
class _Prompt:
    """One prompt's search: its live beams (best first) with their sequences."""

    index: int
    token_ids: list[int]
    blocks: int  # the worst-case KV blocks it may hold
    live: list[tuple[BeamSearchSequence, Sequence]] = field(default_factory=list)
    finished: list[BeamSearchSequence] = field(default_factory=list)
    steps: int = 0
    done: bool = False


def worst_case_blocks(num_prompt_tokens: int, params: BeamSearchParams, block_size: int) -> int:
    """The prompt's full blocks once, and for each beam every block past them at the last step
    (the beams' final tokens are chosen, never computed)."""
    shared = num_prompt_tokens // block_size
    return shared + params.beam_width * (cdiv(num_prompt_tokens + params.max_tokens - 1, block_size) - shared)


class BeamSearchRun:
    def __init__(self, engine: SequenceEngine, token_prompts: list[list[int]], params: BeamSearchParams):
        self.engine = engine
        self.params = params
        self.step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
        self.step_params.validate()
        self.prompts = [self._check(i, ids) for i, ids in enumerate(token_prompts)]
        self.pending = deque(self.prompts)
        self.running: list[_Prompt] = []
        self.entries: dict[int, dict[int, Logprob]] = {}  # seq_id -> this step's logprob entry
        self.parked: dict[int, Sequence] = {}  # seq_id -> a beam waiting for the rest of its prompt

    def _check(self, index: int, ids: list[int]) -> _Prompt:
        engine, params = self.engine, self.params
        try:
            engine.check_request(ids, self.step_params)
            if len(ids) + params.max_tokens > engine.max_model_len:
                raise ValueError(
                    f"the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} exceed the "
                    f"model's context of {engine.max_model_len} tokens"
                )
            if params.beam_width > engine.max_num_seqs:
                raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs={engine.max_num_seqs}")
            bm = engine.block_manager
            blocks = worst_case_blocks(len(ids), params, bm.block_size)
            if blocks > bm.num_blocks:
                raise ValueError(
                    f"beam search may need {blocks} KV blocks for this prompt (beam_width="
                    f"{params.beam_width}, max_tokens={params.max_tokens}) but the pool has only "
                    f"{bm.num_blocks}"
                )
        except ValueError as exc:
            raise ValueError(f"prompt {index}: {exc}") from exc
        return _Prompt(index, list(ids), blocks)

    def run(self) -> list[BeamSearchOutput]:
        engine = self.engine
        with engine.stepping():
            try:
                while self.pending or self.running:
                    self._start_prompts()
                    steps = engine.stats["steps"]
                    engine.step()
                    if engine.stats["steps"] == steps:
                        raise RuntimeError(
                            "beam search cannot go on: nothing could be scheduled (the KV pool is "
                            "held by other requests)"
                        )
                    self._collect()
            except BaseException:
                for prompt in self.running:
                    for _, seq in prompt.live:
                        self._free(seq)
                raise
        eos, tokenizer = engine.eos_token_id, engine.tokenizer
        return [best_sequences([b for b, _ in p.live], p.finished, eos, self.params, tokenizer) for p in self.prompts]

    def _start_prompts(self) -> None:
        """Hand prompts to the scheduler while their worst cases fit beside the running ones."""
        engine = self.engine
        while self.pending:
            prompt = self.pending[0]
            held = sum(p.blocks for p in self.running)
            beams = self.params.beam_width * (len(self.running) + 1)
            if self.running and (held + prompt.blocks > engine.block_manager.num_blocks or beams > engine.max_num_seqs):
                return
            self.pending.popleft()
            seq = Sequence(engine.new_seq_id(), f"beam-search-{prompt.index}", 0, prompt.token_ids, self.step_params)
            seq.on_logprobs = self._receive
            prompt.live = [(BeamSearchSequence(list(prompt.token_ids)), seq)]
            self.running.append(prompt)
            engine.scheduler.add(seq)
            engine.stats["prompt_tokens"] += len(prompt.token_ids)

    def _receive(self, seq: Sequence, entry: dict[int, Logprob]) -> None:
        self.entries[seq.seq_id] = entry

    def _collect(self) -> None:
        """Park the beams that got their entry; advance every prompt whose beams all have theirs."""
        running = self.engine.scheduler.running
        got = [s for s in running if s.seq_id in self.entries]
        if got:
            running[:] = [s for s in running if s.seq_id not in self.entries]
            self.parked.update((s.seq_id, s) for s in got)
        for prompt in self.running:
            if all(seq.seq_id in self.parked for _, seq in prompt.live):
                self._advance(prompt)
        self.running = [p for p in self.running if not p.done]

    def _advance(self, prompt: _Prompt) -> None:
        engine, params = self.engine, self.params
        seqs = [seq for _, seq in prompt.live]
        entries = [self.entries.pop(seq.seq_id) for seq in seqs]
        for seq in seqs:
            del self.parked[seq.seq_id]
        chosen, finished = next_beams([b for b, _ in prompt.live], entries, engine.eos_token_id, params)
        prompt.finished += finished
        prompt.steps += 1
        engine.stats["generation_tokens"] += len(seqs)  # a next token for each beam, as the metrics count
        if prompt.steps == params.max_tokens or not chosen:
            for seq in seqs:
                self._free(seq)
            prompt.live = [(beam, None) for _, beam in chosen]
            prompt.done = True
            return
        extended = {i for i, _ in chosen}
        for i, seq in enumerate(seqs):
            if i not in extended:
                self._free(seq)  # before any fork, so that its blocks can serve the copies
        live, forks, copies = [], [], []
        try:
            for i, beam in chosen:
                parent = seqs[i]
                if any(seq is parent for _, seq in live):
                    seq = parent.fork(engine.new_seq_id())
                    forks.append(seq)
                    pair = engine.block_manager.fork(parent, seq)
                    if pair is not None:
                        copies.append(pair)
                else:
                    seq = parent
                live.append((beam, seq))
            engine.copy_blocks(copies)
        except BaseException:
            for seq in forks:  # the parents are still the prompt's, freed by run()
                self._free(seq)
            raise
        for beam, seq in live:  # only now: a fork copies its parent's tokens
            seq.append_token(beam.tokens[-1])
            engine.scheduler.running.append(seq)
        prompt.live = live

    def _free(self, seq: Sequence | None) -> None:
        """Take a beam out of the engine and return its blocks."""
        if seq is None:
            return
        self.entries.pop(seq.seq_id, None)
        self.parked.pop(seq.seq_id, None)
        scheduler = self.engine.scheduler
        if seq in scheduler.running or seq in scheduler.waiting:
            scheduler.finish(seq)
        else:  # parked, or a fork not yet handed to the scheduler
            self.engine.block_manager.release(seq)
            seq.status = SequenceStatus.FINISHED


def run_beam_search(llm, token_prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    return BeamSearchRun(llm.llm_engine, token_prompts, params).run()
