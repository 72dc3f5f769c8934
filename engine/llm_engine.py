"""The step-level engine: add requests, step, collect finished outputs (like vLLM's LLMEngine)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager, cdiv
from engine.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from engine.encoder_config import EncoderConfig
from engine.encoder_runner import EncoderRunner, load_encoder_config
from engine.generation_config import default_sampling_values, eos_ids, read_generation_config
from engine.kv_export import KVBundle, KVTransfer, wants_export
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.pooling import (
    forward_with_pooling,
    has_pooling,
    num_prompt_tokens,
    pooled_sequences,
    pooling_output,
    pooling_request,
)
from engine.pooling_runner import resolve_runner
from engine.prompt_logprobs import plan as plan_prompt_logprobs
from engine.prompt_logprobs import record as record_prompt_logprobs
from engine.request_checks import check_against_model, check_priority, truncate_prompt
from engine.sampler import SampleLogprobs, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.st_dense import load_dense_head
from engine.stop_strings import StopStrings
from engine.stopping import StopChecker
from engine.structured_outputs import StructuredOutputs, advance
from engine.token_masks import bad_words_token_ids
from engine.tokenizer import Detokenizer, encode_prompt, load_tokenizer

log = logging.getLogger(__name__)

Prompt = str | dict


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    kv_import: KVBundle | None = None  # a decode half, until its KV is in the pool
    grammar: Future | None = None  # the compiled grammar under structured outputs


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=str(model), **kwargs)
        cfg = self.config
        self.model_config = load_encoder_config(model, cfg.max_model_len, cfg.revision, cfg.hf_overrides) or \
            ModelConfig.load(model, cfg.max_model_len, cfg.revision, cfg.hf_overrides)
        self.max_model_len = self.model_config.max_model_len
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device, self.model_config.torch_dtype)
        torch.manual_seed(self.config.seed)
        self.tokenizer = load_tokenizer(cfg.tokenizer or str(self.model_config.path), cfg.tokenizer_mode,
                                        cfg.tokenizer_revision or (cfg.revision if cfg.tokenizer is None else None))
        self.generation_config = read_generation_config(self.model_config.path, cfg.generation_config)
        self.default_sampling_values = default_sampling_values(
            self.generation_config, cfg.generation_config, cfg.override_generation_config
        )
        self.eos_token_id, self.extra_eos_ids = self._eos_ids()
        self.eos_token_ids = sorted({self.eos_token_id, *self.extra_eos_ids} - {None})
        self.pooler_config = resolve_runner(self.config, self.model_config)  # None: a generative runner
        encoder = isinstance(self.model_config, EncoderConfig)
        self.runner = (EncoderRunner if encoder else ModelRunner)(self.config, self.model_config, self.device,
                                                                  self.dtype)
        self.pooling_head = load_dense_head(self.pooler_config.dense) if self.pooler_config else None
        self.block_manager = BlockManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
            self.config.scheduling_policy, whole_prompts=encoder,
        )
        self.sampler = Sampler(self.model_config.vocab_size, self.device, self.config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.stopping = StopChecker(self.eos_token_id, self.extra_eos_ids, self.detokenizer, self.max_model_len)
        self.kv = KVTransfer(self)  # prefill/decode disaggregation (engine/kv_export.py)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                            cache_entries=cfg.grammar_cache_size)
        self.requests: dict[str, _Request] = {}  # admitted to the scheduler
        self._incoming: deque[_Request] = deque()  # added, not yet admitted
        self._known_ids: set[str] = set()  # ids of both
        # Stepping holds `_lock` for a whole step; adding only needs the short `_intake_lock`,
        # so a request added from another thread never waits for a step to finish.
        self._lock = threading.RLock()
        self._intake_lock = threading.Lock()
        self._seq_ids = itertools.count()
        self.stats = {"steps": 0, "batched_seqs": 0, "tokens": 0, "preemptions": 0, "prompt_tokens": 0,
                      "generation_tokens": 0, "finished_reasons": {}}

    def _eos_ids(self) -> tuple[int | None, set[int]]:
        """The tokenizer's EOS (stop_reason None) and generation_config's other EOS ids, which
        stop like stop_token_ids (stop_reason: the id), as in vLLM."""
        primary = self.tokenizer.eos_token_id
        extra = set(eos_ids(self.generation_config, self.model_config.eos_token_ids))
        if primary is None and extra:
            primary = min(extra)
        return primary, extra - {primary}

    # ---- requests ------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            vocab = self.model_config.vocab_size
            if not isinstance(ids, list | tuple):
                raise ValueError("prompt_token_ids must be a list of integers")
            # the common case checked in C (type, min and max: ~10x a Python loop per token)
            plain = not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab)
            if not plain:
                if not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:  # vLLM's words (it names the largest id; a negative one is named here too)
                    worst = min(bad) if min(bad) < 0 else max(bad)
                    raise ValueError(f"Token id {worst} is out of vocabulary (the vocabulary is [0, {vocab}))")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    def prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids (truncated as `truncate_prompt_tokens` says), checked
        with `params`; raises ValueError for a request that can never be served."""
        params.validate()
        if params.extra_args and "kv_transfer_params" in params.extra_args:
            self.kv.check_params(params)
        text, ids = self.tokenize(prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
        self.check_request(ids, params)
        return text, ids

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never be served."""
        if not self.runner.has_lm_head:
            raise ValueError("this model has no language-model head (a pooling model): it can only embed")
        check_against_model(params, self.model_config.vocab_size, self.config.max_logprobs)
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)
        n, limit = len(prompt_token_ids), self.max_model_len
        if n == 0:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's words, here and below
        if n >= limit:
            plus = "" if n > limit else " plus the number of requested output tokens (at least 1)"
            raise ValueError(f"The decoder prompt (length {n}){plus} is longer than the maximum model length of "
                             f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
        total = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        blocks = cdiv(total, self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks ({total} tokens) but the pool has only "
                f"{self.block_manager.num_blocks}"
            )

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request; safe to call from any thread, also while another thread steps.
        `priority` (lower first) ranks requests under scheduling_policy="priority"; under fcfs it is
        accepted and changes nothing, as in vLLM V1."""
        check_priority(priority, self.config.scheduling_policy)
        params = params or SamplingParams(**self.default_sampling_values)
        text, ids = self.prepare(prompt, params)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
        arrival = arrival_time or time.time()
        stop_strings = StopStrings(params.stop_strings)  # indexed once, outside the engine lock
        seqs = [Sequence(next(self._seq_ids), request_id, i, ids, params, arrival, stop_strings)
                for i in range(params.n)]
        for seq in seqs:
            seq.bad_words_token_ids = bad_words
            seq.priority = priority
        grammar = self.structured.start(params.structured_outputs) if params.structured_outputs else None
        self._enqueue(_Request(request_id, text, ids, params, seqs, grammar=grammar))

    def add_pooling_request(self, request_id: str, prompt: Prompt | list[Prompt], params=None,
                            arrival_time: float | None = None) -> None:
        """Queue an embedding request (engine.pooling): one prompt, or a list of prompts pooled under
        one request id into one output; `params`: a PoolingParams. Any thread."""
        text, ids, seqs = pooling_request(self, self._seq_ids, request_id, prompt, params, arrival_time)
        self._enqueue(_Request(request_id, text, ids, seqs[0].params, seqs))

    def _enqueue(self, req: _Request) -> None:
        with self._intake_lock:
            if req.request_id in self._known_ids:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._known_ids.add(req.request_id)
            self._incoming.append(req)

    def add_imported_request(self, request_id: str, bundle: KVBundle, params: SamplingParams) -> None:
        """Queue the decode half of a request prefilled by another engine (engine/kv_export.py)."""
        self.kv.check(bundle, params)
        text, ids = self.prepare({"prompt_token_ids": bundle.prompt_token_ids}, params)
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, params, time.time(), StopStrings(params.stop_strings))
        if params.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self._enqueue(_Request(request_id, bundle.prompt, ids, params, [seq], kv_import=bundle))

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now; its blocks return to the pool at once. False if unknown."""
        with self._lock:
            with self._intake_lock:
                if request_id not in self._known_ids:
                    return False
                self._known_ids.discard(request_id)
                for req in self._incoming:
                    if req.request_id == request_id:
                        self._incoming.remove(req)
                        return True
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            if self.kv.drop(req):
                return True
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
            return True

    def pause_requests(self, request_ids) -> None:
        """Skip these requests' sequences in the next steps (they keep their KV blocks) until the next call."""
        self.scheduler.paused = frozenset(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._known_ids)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._known_ids)

    # ---- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that finished in it."""
        with self._lock:
            finished: list[RequestOutput] = self._admit_incoming()
            finished += self.kv.admit()
            batch = self.scheduler.schedule()
            if not batch:
                self._wait_for_grammars()
                return finished
            spans, rows = plan_prompt_logprobs(batch)
            if has_pooling(batch):
                logits, hidden = forward_with_pooling(self.runner, batch, rows)
            else:
                logits, hidden = self.runner.execute(batch, rows) if rows else (self.runner.execute(batch), None)
            if spans:
                record_prompt_logprobs(spans, hidden, self.runner.model.compute_logits,
                                       self.model_config.vocab_size, self._logprob_entry)
            samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
                        if s.num_computed_tokens + n == len(s) and s.pooling is None]
            tokens, logprobs = self.sampler(logits, samplers, self.eos_token_ids) if samplers else ([], None)
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens += n
                self.block_manager.register_full_blocks(seq)
            for seq in pooled_sequences(batch):  # pooled: done, blocks back to the pool now
                self._finish(seq, "stop", None)
                output = self._request_done(seq)
                if output is not None:
                    finished.append(output)
            for i, seq in enumerate(samplers):
                if seq.on_logprobs is not None:  # a beam: the search picks its next tokens
                    seq.on_logprobs(seq, self._logprob_entry(seq, logprobs[i]))
                    continue
                seq.append_token(tokens[i])
                grammar_done = advance(seq, tokens[i])
                if logprobs is not None and seq.logprobs is not None:
                    self._record_logprobs(seq, logprobs[i])
                self._check_stop(seq)
                if grammar_done and not seq.is_finished:  # only with ignore_eos: nothing may follow
                    self._finish(seq, "stop", None)
                if not seq.is_finished and wants_export(seq):
                    finished.append(self.kv.export(seq))
                elif seq.is_finished:
                    output = self._request_done(seq)
                    if output is not None:
                        finished.append(output)
            self.stats["steps"] += 1
            self.stats["batched_seqs"] += len(batch.seqs)
            self.stats["tokens"] += batch.num_tokens
            self.stats["preemptions"] = self.scheduler.num_preemptions
            return finished

    def _admit_incoming(self) -> list[RequestOutput]:
        """Hand the added requests to the scheduler; a request whose grammar is still compiling
        stays queued (in order) for a later step. Returns those whose grammar failed, finished."""
        ready, compiling = [], deque()
        with self._intake_lock:
            for req in self._incoming:  # each future looked at once: it may finish meanwhile
                (compiling if req.grammar is not None and not req.grammar.done() else ready).append(req)
            self._incoming = compiling
        failed = []
        for req in ready:
            self.requests[req.request_id] = req
            if req.kv_import is not None:  # a decode half: admitted once its KV is in the pool
                self.kv.pending.append(req)
                continue
            if req.grammar is not None:
                try:
                    self.structured.attach(req.seqs, req.grammar)
                except Exception as exc:  # noqa: BLE001 - check_request built it; compiling can still fail
                    log.error("request %s: its grammar failed to compile: %s", req.request_id, exc)
                    for seq in req.seqs:
                        seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
                    failed.append(self._request_done(req.seqs[0]))
                    continue
            for seq in req.seqs:
                self.scheduler.add(seq)
        return failed

    def _wait_for_grammars(self) -> None:
        """With nothing to run, wait (briefly) for a queued request's grammar instead of spinning."""
        with self._intake_lock:
            pending = [r.grammar for r in self._incoming if r.grammar is not None]
        if pending:
            wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)

    def _logprob_entry(self, seq: Sequence, sample: SampleLogprobs) -> dict[int, Logprob]:
        """vLLM's shape: the sampled (or prompt) token first, then the top tokens by rank."""
        text = self.detokenizer.token_text if seq.params.detokenize else (lambda _: None)
        entry = {sample.token_id: Logprob(sample.logprob, sample.rank, text(sample.token_id))}
        for rank, (token, value) in enumerate(zip(sample.top_ids, sample.top_values), 1):
            if token not in entry:
                entry[token] = Logprob(value, rank, text(token))
        return entry

    def _record_logprobs(self, seq: Sequence, sample: SampleLogprobs) -> None:
        seq.logprobs.append(self._logprob_entry(seq, sample))
        seq.cumulative_logprob += sample.logprob

    def _check_stop(self, seq: Sequence) -> None:
        finished = self.stopping.check(seq)
        if finished is not None:
            self._finish(seq, *finished)

    def _finish(self, seq: Sequence, reason: str, stop: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop
        self.scheduler.finish(seq)

    def _request_done(self, seq: Sequence) -> RequestOutput | None:
        req = self.requests.get(seq.request_id)
        if req is None or not all(s.is_finished for s in req.seqs):
            return None
        del self.requests[seq.request_id]
        self.stats["prompt_tokens"] += num_prompt_tokens(req.prompt_token_ids)
        for s in req.seqs:
            self.stats["generation_tokens"] += s.num_output_tokens
            reasons = self.stats["finished_reasons"]  # a few fixed keys: stop, length
            reasons[s.finish_reason] = reasons.get(s.finish_reason, 0) + 1
        with self._intake_lock:
            self._known_ids.discard(seq.request_id)
        if seq.pooling is not None:
            return pooling_output(req)
        return self._make_output(req)

    @staticmethod
    def _make_output(req: _Request) -> RequestOutput:
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

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks
