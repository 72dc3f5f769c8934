"""One engine step as five phases, each a function from one dataclass to the next (as vLLM v1's
`SchedulerOutput` -> `ModelRunnerOutput`):

    schedule(engine)                      -> ScheduleResult  which sequences run, how many tokens each
    build_inputs(ScheduleResult)          -> ModelInputs     who samples, which hidden rows to keep
    run_model(engine, ModelInputs)        -> ModelOutputs    logits (and kept hidden states)
    sample(engine, inputs, ModelOutputs)  -> SampledTokens   a token (and logprobs) per sampling sequence
    update(engine, inputs, SampledTokens) -> StepResult      tokens appended, stops, finished outputs

`LLMEngine.step` runs them in this order under its lock. The phases share the engine's state
(scheduler, block manager, runner) through the engine; what passes from one to the next is in
the dataclasses. `engine` is the `LLMEngine` that steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import repeat

import torch

from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence, SequenceStatus
from engine.kv_transfer.export import wants_export
from engine.params.outputs import CompletionOutput, Logprob, RequestOutput
from engine.pooling.requests import forward_with_pooling, has_pooling, pooled_sequences
from engine.sampling.prompt_logprobs import plan as plan_prompt_logprobs
from engine.sampling.prompt_logprobs import record as record_prompt_logprobs
from engine.sampling.sampler import SampleLogprobs
from engine.sampling.structured_outputs import advance as advance_grammar

_FINISHED = SequenceStatus.FINISHED


@dataclass
class ScheduleResult:
    batch: ScheduledBatch | None  # None: nothing can run this step
    finished: list[RequestOutput] = field(default_factory=list)  # requests that ended before running


@dataclass
class ModelInputs:
    batch: ScheduledBatch
    prompt_logprob_spans: list  # sampling.prompt_logprobs: whose prompt logprobs this step computes
    hidden_rows: list[int]  # token rows whose hidden states the prompt logprobs need
    samplers: list[Sequence]  # those whose last token this step computes: each gets a next token
    pooling: bool  # some sequence is a pooling request


@dataclass
class ModelOutputs:
    logits: torch.Tensor  # one row per sampling position
    hidden: torch.Tensor | None  # the hidden states of `hidden_rows`


@dataclass
class SampledTokens:
    tokens: list[int]  # one per `ModelInputs.samplers`
    logprobs: list[SampleLogprobs] | None  # one per sampler, when some sequence asked for logprobs


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)  # includes prefill-only exports
    num_seqs: int = 0
    num_tokens: int = 0


def schedule(engine) -> ScheduleResult:
    """Admit the added requests (and imported KV), then pick this step's batch."""
    finished = engine.admit_incoming()
    finished += engine.kv.admit()
    batch = engine.scheduler.schedule()
    prefault = getattr(engine.runner, "kv_prefault", None)
    if prefault is not None:  # the pages of the blocks later steps take, mapped meanwhile
        prefault.ensure(engine.block_manager.num_used)
    return ScheduleResult(batch or None, finished)


def build_inputs(scheduled: ScheduleResult) -> ModelInputs:
    batch = scheduled.batch
    spans, rows = plan_prompt_logprobs(batch)
    samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == len(s.token_ids)]
    pooling = has_pooling(batch)
    if pooling:
        samplers = [s for s in samplers if s.pooling is None]
    return ModelInputs(batch, spans, rows, samplers, pooling)


def run_model(engine, inputs: ModelInputs, feed=None) -> ModelOutputs:
    """`feed`: the inputs to take from the step in flight (engine.core.async_steps)."""
    runner, batch, rows = engine.runner, inputs.batch, inputs.hidden_rows
    if inputs.pooling:
        logits, hidden = forward_with_pooling(runner, batch, rows)
    elif feed is not None:
        logits, hidden = runner.execute(batch, rows, feed) if rows else (runner.execute(batch, None, feed), None)
    else:
        logits, hidden = runner.execute(batch, rows) if rows else (runner.execute(batch), None)
    return ModelOutputs(logits, hidden)


def sample(engine, inputs: ModelInputs, outputs: ModelOutputs) -> SampledTokens:
    """Prompt logprobs from the kept hidden states, then a next token per sampling sequence."""
    if inputs.prompt_logprob_spans:
        record_prompt_logprobs(
            inputs.prompt_logprob_spans,
            outputs.hidden,
            engine.runner.model.compute_logits,
            engine.model_config.vocab_size,
            engine.logprob_entry,
        )
    if not inputs.samplers:
        return SampledTokens([], None)
    tokens, logprobs = engine.sampler(outputs.logits, inputs.samplers, engine.eos_token_ids)
    return SampledTokens(tokens, logprobs)


def update(engine, inputs: ModelInputs, sampled: SampledTokens) -> StepResult:
    """Advance every scheduled sequence; append the sampled tokens, check stops, hand back finished
    requests (and the KV of prefill-only ones)."""
    batch, finished = inputs.batch, []
    advance(engine, batch)
    if inputs.pooling:
        for seq in pooled_sequences(batch):  # pooled: done, blocks back to the pool now
            engine.finish_seq(seq, "stop", None)
            _collect(engine.request_done(seq), finished)
    take_tokens(engine, inputs.samplers, sampled.tokens, sampled.logprobs, finished)
    return StepResult(finished, len(batch.seqs), batch.num_tokens)


def advance(engine, batch: ScheduledBatch) -> None:
    """Count the step's tokens as computed; offer the blocks they filled to the prefix cache. A sequence
    that finished since it was scheduled (its tokens read a step late: engine.core.async_steps) is left."""
    blocks = engine.block_manager
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.status is _FINISHED:
            continue
        seq.num_computed_tokens += n
        if seq.num_computed_tokens // blocks.block_size > seq.num_registered_blocks:  # a block filled up
            blocks.register_full_blocks(seq)


def take_tokens(engine, samplers, tokens, logprobs, finished: list) -> None:
    """Append each sampler's token (and logprobs), check its stops; collect the requests that end."""
    check = engine.stopping.check
    for seq, token, sample_i in zip(samplers, tokens, logprobs or repeat(None)):
        if seq.status is _FINISHED:
            continue
        if seq.on_logprobs is not None:  # a beam: the search picks its next tokens
            seq.on_logprobs(seq, engine.logprob_entry(seq, sample_i))
            continue
        seq.append_token(token)
        grammar_done = seq.grammar is not None and advance_grammar(seq, token)
        if sample_i is not None and seq.logprobs is not None:
            seq.logprobs.append(engine.logprob_entry(seq, sample_i))
            seq.cumulative_logprob += sample_i.logprob
        stop = check(seq)
        if stop is not None:
            engine.finish_seq(seq, *stop)
        elif grammar_done:  # only with ignore_eos: nothing may follow
            engine.stopping.catch_up(seq)
            engine.finish_seq(seq, "stop", None)
        else:
            if seq.params.extra_args and wants_export(seq):
                engine.stopping.catch_up(seq)
                finished.append(engine.kv.export(seq))
            continue
        _collect(engine.request_done(seq), finished)


def _collect(output, finished: list) -> None:
    if output is not None:
        finished.append(output)


def logprob_entry(token_text, sample: SampleLogprobs) -> dict[int, Logprob]:
    """vLLM's shape: the sampled (or prompt) token first, then the top tokens by rank;
    `token_text(id)` is a token's text (None without detokenizing)."""
    entry = {sample.token_id: Logprob(sample.logprob, sample.rank, token_text(sample.token_id))}
    for rank, (token, value) in enumerate(zip(sample.top_ids, sample.top_values), 1):
        if token not in entry:
            entry[token] = Logprob(value, rank, token_text(token))
    return entry


def request_output(req) -> RequestOutput:
    """A request's `RequestOutput` from its sequences (`req`: LLMEngine's request record)."""
    first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=s.index,
                text=s.output_text,
                token_ids=s.output_token_ids,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=s.logprobs,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            )
            for s in req.seqs
        ],
        num_cached_tokens=max(s.num_cached_tokens for s in req.seqs),
        prompt_logprobs=req.seqs[0].prompt_logprobs,
        metrics={"arrival_time": req.seqs[0].arrival, "first_token_time": first, "finished_time": time.time()},
    )
