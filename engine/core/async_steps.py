"""Async scheduling (vLLM's `async_scheduling`): a step's sampled tokens are read back one step late.

While step N runs on the device, the engine schedules step N+1 as if N's tokens were known: each
sequence that samples in N ends its tokens with a placeholder, which N+1 takes as its input straight
from N's sampled-token tensor on the device (`Feed`), with no round trip through the host. With N+1
queued, the host reads N's tokens, puts them in place of the placeholders, checks stops and builds
the outputs: its work hides behind the device's. A sequence that N stops has computed one token too
many in N+1; that token is dropped. A sequence whose step N reaches its max_tokens or the context
gets no placeholder (it is not scheduled again), so a length stop wastes nothing.

Greedy and seeded sampling give the tokens they give without it. A step with a sequence whose next
token depends on its earlier ones on the host (a grammar, penalties, min_tokens, bad words, a beam,
a KV export) or that returns prompt logprobs or pooled states runs synchronously: its tokens are
read, and the step before it finished, before the next step is scheduled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core import step_phases as phases
from engine.core.sequence import Sequence, SequenceStatus
from engine.runner.device import to_device
from engine.sampling.sampler import PendingSample

PLACEHOLDER = -1  # never reaches the model: every placeholder input is fed from the device
_FINISHED = SequenceStatus.FINISHED


@dataclass
class Feed:
    """Where a step's inputs take the previous step's sampled tokens: input rows `rows` get the
    tokens at `sampled_rows` of `tokens` (on the device)."""

    rows: list[int]
    sampled_rows: list[int]
    tokens: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> torch.Tensor:
        device = input_ids.device
        rows = to_device(self.rows, torch.long, device)
        sampled = self.tokens.index_select(0, to_device(self.sampled_rows, torch.long, device))
        return input_ids.index_copy_(0, rows, sampled.to(input_ids.dtype))


@dataclass
class InFlight:
    """A step whose tokens are not read yet: its samplers (the rows of `sampled`) and the sampling
    still on the device (None: no sequence sampled)."""

    samplers: list[Sequence]
    sampled: PendingSample | None


def wanted(setting: bool | None, device: torch.device, runner) -> bool:
    """EngineConfig.async_scheduling: None is on where the device runs apart from the host (CUDA); a runner
    that cannot take its inputs from the device (tensor parallelism's) steps synchronously."""
    on = setting if setting is not None else device.type == "cuda"
    return bool(on and getattr(runner, "feeds_sampled_tokens", False))


def run(engine, inputs: phases.ModelInputs) -> list:
    """Run a scheduled step. Where it may be deferred: launch it, read the step in flight (the device
    meanwhile runs this one), book this one as in flight. Else: run it, read the step in flight, then
    this one. Returns the requests that finished."""
    outputs = phases.run_model(engine, inputs, feed(engine.in_flight, inputs.batch))
    if engine.async_scheduling and can_defer(inputs):
        sampled = None
        if inputs.samplers:
            sampled = engine.sampler.launch(outputs.logits, inputs.samplers, engine.eos_token_ids)
        finished = drain(engine)
        engine.in_flight = launch(engine, inputs, sampled)
        return finished
    sampled = phases.sample(engine, inputs, outputs)
    finished = drain(engine)
    return finished + phases.update(engine, inputs, sampled).finished


def drain(engine) -> list:
    """Read the step in flight, if any: its tokens in place of the placeholders, stops checked as a
    synchronous step checks them. Returns the requests that finished."""
    flight, engine.in_flight = engine.in_flight, None
    finished: list = []
    if flight is None or flight.sampled is None:
        return finished
    tokens, logprobs = flight.sampled.result()
    for seq in flight.samplers:  # a placeholder is its sequence's last token until its step is read
        if seq.num_pending and seq.status is not _FINISHED:
            seq.token_ids.pop()
            seq.num_pending = 0
    phases.take_tokens(engine, flight.samplers, tokens, logprobs, finished)
    return finished


def can_defer(inputs: phases.ModelInputs) -> bool:
    """Whether the step's tokens may be read a step late (see the module's docstring)."""
    if inputs.pooling or inputs.prompt_logprob_spans:
        return False
    for seq in inputs.samplers:
        if seq.reads_own_tokens is None:
            seq.reads_own_tokens = _reads_own_tokens(seq)
        if seq.reads_own_tokens:
            return False
    return True


def _reads_own_tokens(seq: Sequence) -> bool:
    """Whether the sequence's sampling or stopping needs its earlier tokens on the host."""
    p = seq.params
    return bool(
        seq.on_logprobs is not None
        or seq.grammar is not None
        or p.min_tokens
        or p.bad_words
        or p.has_penalties
        or (p.extra_args and "kv_transfer_params" in p.extra_args)
    )


def feed(flight: InFlight | None, batch) -> Feed | None:
    """The rows of `batch` whose input is a placeholder of the step in flight (a step is scheduled
    while a sequence's one placeholder, from that step, is its last token)."""
    if flight is None or flight.sampled is None:
        return None
    seqs = batch.seqs
    if batch.num_tokens == len(seqs):  # one token each (decodes): a row per sequence
        rows = [i for i, s in enumerate(seqs) if s.num_pending]
        if not rows:
            return None
        return Feed(rows, [seqs[i].pending_row for i in rows], flight.sampled.tokens)
    rows, sampled_rows, row = [], [], 0
    for seq, n in zip(seqs, batch.num_new_tokens):
        if seq.num_pending:
            offset = len(seq.token_ids) - 1 - seq.num_computed_tokens
            if 0 <= offset < n:
                rows.append(row + offset)
                sampled_rows.append(seq.pending_row)
        row += n
    return Feed(rows, sampled_rows, flight.sampled.tokens) if rows else None


def launch(engine, inputs: phases.ModelInputs, sampled: PendingSample | None) -> InFlight:
    """Book a launched step as if its tokens were known: computed counts, full blocks offered to the
    prefix cache, a placeholder for each token to come that may not be its sequence's last. Sequences
    that the step before stopped are left (their rows of this step are dropped)."""
    phases.advance(engine, inputs.batch)
    limit = engine.max_model_len
    for row, seq in enumerate(inputs.samplers):
        if seq.status is _FINISHED:
            continue
        tokens, max_tokens = seq.token_ids, seq.params.max_tokens
        seq.pending_row = row
        if len(tokens) + 1 < limit and (max_tokens is None or len(tokens) + 1 - seq.num_prompt_tokens < max_tokens):
            tokens.append(PLACEHOLDER)
            seq.num_pending = 1
    return InFlight(inputs.samplers, sampled)
