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
from itertools import repeat

import torch

from engine.core import step_phases as phases
from engine.core.sequence import Sequence, SequenceStatus
from engine.kv_transfer.export import wants_export
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
    """A step whose tokens are not read yet: its samplers, where each one's token goes in its
    `token_ids`, and the sampling still on the device (None: no sequence sampled)."""

    samplers: list[Sequence]
    slots: list[int]
    sampled: PendingSample | None


def wanted(setting: bool | None, device: torch.device, runner) -> bool:
    """EngineConfig.async_scheduling: None is on where the device runs apart from the host (CUDA); a runner
    that cannot take its inputs from the device (tensor parallelism's) steps synchronously."""
    on = setting if setting is not None else device.type == "cuda"
    return bool(on and getattr(runner, "feeds_sampled_tokens", False))


def run(engine, inputs: phases.ModelInputs) -> list:
    """Run a scheduled step: launched, its tokens read in the next call, where it may be; else read now,
    after the step in flight's. Returns the requests that finished."""
    outputs = phases.run_model(engine, inputs, feed(engine.in_flight, inputs.batch))
    if engine.async_scheduling and can_defer(inputs):
        sampled = None
        if inputs.samplers:
            sampled = engine.sampler.launch(outputs.logits, inputs.samplers, engine.eos_token_ids)
        earlier, engine.in_flight = engine.in_flight, launch(engine, inputs, sampled)
        return finish(engine, earlier)
    sampled = phases.sample(engine, inputs, outputs)
    finished = drain(engine)
    return finished + phases.update(engine, inputs, sampled).finished


def drain(engine) -> list:
    """Read the step in flight, if any; returns the requests that finished."""
    flight, engine.in_flight = engine.in_flight, None
    return finish(engine, flight)


def can_defer(inputs: phases.ModelInputs) -> bool:
    """Whether the step's tokens may be read a step late (see the module's docstring)."""
    if inputs.pooling or inputs.prompt_logprob_spans:
        return False
    for seq in inputs.samplers:
        p = seq.params
        if (
            seq.grammar is not None
            or seq.on_logprobs is not None
            or p.min_tokens
            or p.bad_words
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
            or (p.extra_args and wants_export(seq))
        ):
            return False
    return True


def feed(flight: InFlight | None, batch) -> Feed | None:
    """The rows of `batch` whose input is a placeholder of the step in flight. When a step is
    scheduled, a sequence has at most one placeholder, its last token, from that step."""
    if flight is None or flight.sampled is None:
        return None
    rows, sampled_rows, row = [], [], 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.num_pending:
            offset = len(seq.token_ids) - 1 - seq.num_computed_tokens
            if 0 <= offset < n:
                rows.append(row + offset)
                sampled_rows.append(seq.pending_row)
        row += n
    return Feed(rows, sampled_rows, flight.sampled.tokens) if rows else None


def launch(engine, inputs: phases.ModelInputs, sampled: PendingSample | None) -> InFlight:
    """Advance the step's sequences as if its tokens were known: computed counts, full blocks
    offered to the prefix cache, a placeholder for each sampled token that may not be the last."""
    phases.advance(engine, inputs.batch)
    slots, limit = [], engine.max_model_len
    for row, seq in enumerate(inputs.samplers):
        tokens = seq.token_ids
        slots.append(len(tokens))
        seq.pending_row = row
        max_tokens = seq.params.max_tokens
        if len(tokens) + 1 < limit and (max_tokens is None or len(tokens) + 1 - seq.num_prompt_tokens < max_tokens):
            tokens.append(PLACEHOLDER)
            seq.num_pending += 1
    return InFlight(inputs.samplers, slots, sampled)


def finish(engine, flight: InFlight | None) -> list:
    """Read a launched step's tokens and take them as a synchronous step would; returns the
    requests that finished."""
    finished: list = []
    if flight is None or flight.sampled is None:
        return finished
    tokens, logprobs = flight.sampled.result()
    live, tails = [], []
    for seq, slot, token, sample in zip(flight.samplers, flight.slots, tokens, logprobs or repeat(None)):
        if seq.status is _FINISHED:  # aborted meanwhile
            continue
        tails.append(seq.token_ids[slot + 1 :])  # the placeholder of a step launched since
        del seq.token_ids[slot:]
        seq.num_pending = 0
        live.append((seq, token, sample))
    if not live:
        return finished
    seqs, toks, samples = zip(*live)
    phases.take_tokens(engine, seqs, toks, samples if logprobs else None, finished)
    blocks = engine.block_manager
    for seq, tail in zip(seqs, tails):
        if seq.status is _FINISHED:
            continue  # its token from the step launched since is dropped with the placeholder
        if tail:
            seq.token_ids += tail
            seq.num_pending = len(tail)
        if seq.num_computed_tokens // blocks.block_size > seq.num_registered_blocks:
            blocks.register_full_blocks(seq)
    return finished
