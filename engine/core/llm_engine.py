"""The step-level engine: add requests, step, collect finished outputs (like vLLM's LLMEngine)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import AbstractContextManager

import torch

from engine.core import async_steps
from engine.core import step_phases as phases
from engine.core.block_manager import BlockManager, model_window
from engine.core.contract import EngineLoad
from engine.core.request import EngineRequest
from engine.core.request_checks import check_against_model, check_fits, check_priority, truncate_prompt
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.stop_strings import StopStrings
from engine.core.stopping import StopChecker
from engine.hf.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype
from engine.hf.encoder_config import EncoderConfig
from engine.hf.generation_config import default_sampling_values, eos_ids, read_generation_config, split_eos_ids
from engine.hf.tokenizer import Detokenizer, decoding_tokenizer, encode_prompt, eos_token_id, load_tokenizer
from engine.kv_transfer.export import KVBundle, KVTransfer
from engine.lora.slots import register_lora
from engine.multimodal.engine_requests import prepare_request
from engine.parallel.launch import runner_for
from engine.params.outputs import Logprob, RequestOutput
from engine.params.sampling_params import SamplingParams
from engine.pooling.requests import num_prompt_tokens, pooling_output, pooling_request
from engine.pooling.runner_kind import resolve_runner
from engine.pooling.st_dense import load_dense_head
from engine.runner.encoder_runner import load_encoder_config
from engine.sampling.sampler import SampleLogprobs, Sampler
from engine.sampling.structured_outputs import StructuredOutputs
from engine.sampling.token_masks import bad_words_token_ids

log = logging.getLogger(__name__)

Prompt = str | dict


class LLMEngine:
    """The step-level engine; what drives it from outside is written in `engine.core.contract`
    (`StepEngine`; beam search and KV export: `SequenceEngine`), one step's phases in
    `engine.core.step_phases`."""

    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=str(model), **kwargs)
        cfg = self.config
        self.model_config = load_encoder_config(
            model, cfg.max_model_len, cfg.revision, cfg.hf_overrides
        ) or ModelConfig.load(model, cfg.max_model_len, cfg.revision, cfg.hf_overrides)
        self.max_model_len = self.model_config.max_model_len
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device, self.model_config.torch_dtype)
        torch.manual_seed(self.config.seed)
        revision = cfg.tokenizer_revision or (cfg.revision if cfg.tokenizer is None else None)
        self._tokenizer_args = (cfg.tokenizer or str(self.model_config.path), cfg.tokenizer_mode, revision)
        # decoding, token texts and text prompts' ids need no transformers; `tokenizer` (its) loads when first used
        self.decoding_tokenizer = decoding = decoding_tokenizer(*self._tokenizer_args)
        self.generation_config = read_generation_config(self.model_config.path, cfg.generation_config)
        self.default_sampling_values = default_sampling_values(
            self.generation_config, cfg.generation_config, cfg.override_generation_config
        )
        self.eos_token_id, self.extra_eos_ids = split_eos_ids(
            eos_token_id(decoding), eos_ids(self.generation_config, self.model_config.eos_token_ids)
        )
        self.eos_token_ids = sorted({self.eos_token_id, *self.extra_eos_ids} - {None})
        self.pooler_config = resolve_runner(self.config, self.model_config)  # None: a generative runner
        encoder = isinstance(self.model_config, EncoderConfig)
        if cfg.enable_lora and (encoder or self.pooler_config):
            raise ValueError("enable_lora: LoRA adapters apply to text generation only, not to pooling models")
        self.runner = runner_for(cfg, encoder, self.pooler_config is not None)(
            self.config, self.model_config, self.device, self.dtype
        )
        self.pooling_head = load_dense_head(self.pooler_config.dense) if self.pooler_config else None
        window = model_window(self.model_config)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, window)
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.config.scheduling_policy,
            whole_prompts=encoder,
            max_loras=self.config.max_loras if self.config.enable_lora else None,
        )
        self.sampler = Sampler(self.model_config.vocab_size, self.device, self.config.seed)
        self.detokenizer = Detokenizer(decoding)
        self.stopping = StopChecker(self.eos_token_id, self.extra_eos_ids, self.detokenizer, self.max_model_len)
        self.kv = KVTransfer(self)  # prefill/decode disaggregation (engine/kv_transfer/export.py)
        vocab = self.model_config.vocab_size
        self.structured = StructuredOutputs(lambda: self.tokenizer, vocab, self.eos_token_ids, cfg.grammar_cache_size)
        self.requests: dict[str, EngineRequest] = {}  # admitted to the scheduler
        self._incoming: deque[EngineRequest] = deque()  # added, not yet admitted
        self._known_ids: set[str] = set()  # ids of both
        # Stepping holds `_lock` for a whole step; adding only needs the short `_intake_lock`,
        # so a request added from another thread never waits for a step to finish.
        self._lock = threading.RLock()
        self._intake_lock = threading.Lock()
        self._seq_ids = itertools.count()
        self.stats = dict(steps=0, batched_seqs=0, tokens=0, preemptions=0, prompt_tokens=0, generation_tokens=0)
        self.stats["finished_reasons"] = {}
        self.async_scheduling = async_steps.wanted(cfg.async_scheduling, self.device, self.runner)
        self.in_flight: async_steps.InFlight | None = None  # a launched step whose tokens are not read yet

    @property
    def tokenizer(self):  # transformers' (text prompts, chat templates), loaded when first asked for
        return load_tokenizer(*self._tokenizer_args)

    # ---- requests ------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, encode_prompt(self.decoding_tokenizer, prompt)
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
        getattr(self.runner, "check_params", lambda _: None)(params)  # what a tensor-parallel runner cannot serve
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)
        check_fits(
            len(prompt_token_ids),
            params.max_tokens,
            self.max_model_len,
            self.config.block_size,
            self.block_manager.num_blocks,
            sliding=self.block_manager.sliding(params, self.config.max_num_batched_tokens),
        )

    def add_request(
        self, request_id: str, prompt: Prompt, params=None, arrival_time=None, priority=0, lora_request=None
    ):
        """Queue a request; safe to call from any thread, also while another thread steps.
        `priority` (lower first) ranks requests under scheduling_policy="priority"; under fcfs it is
        accepted and changes nothing, as in vLLM V1. `lora_request`: an `engine.LoRARequest` (or the prompt dict's)."""
        self.add_prepared_request(request_id, prompt, params, None, arrival_time, priority, lora_request)

    def prepare_request(self, prompt: Prompt, params: SamplingParams):
        """The request checked and tokenized (images loaded) for `add_prepared_request`; any thread."""
        return prepare_request(self, prompt, params)

    def add_prepared_request(
        self, request_id, prompt, params, prepared, arrival_time=None, priority=0, lora_request=None
    ):
        """`add_request`, given what `prepare_request(prompt, params)` gave (LLM.generate checks all first; the
        worker's host, in the submitting thread, so that its engine loop only queues)."""
        check_priority(priority, self.config.scheduling_policy)
        params = params or SamplingParams(**self.default_sampling_values)
        lora_id = register_lora(self.runner, lora_request, prompt)
        text, ids, images = prepared or prepare_request(self, prompt, params)
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
        arrival = arrival_time or time.time()
        stop_strings = StopStrings(params.stop_strings)  # indexed once, outside the engine lock
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, ids, params, arrival, stop_strings) for i in range(params.n)
        ]
        for seq in seqs:
            seq.bad_words_token_ids, seq.priority, seq.mm = bad_words, priority, images
            seq.lora_id = lora_id
        grammar = self.structured.start(params.structured_outputs) if params.structured_outputs else None
        self._enqueue(EngineRequest(request_id, text, ids, params, seqs, grammar=grammar))

    def add_pooling_request(
        self, request_id: str, prompt: Prompt | list[Prompt], params=None, arrival_time: float | None = None
    ) -> None:
        """Queue an embedding request (engine.pooling.requests): one prompt, or a list of prompts pooled under
        one request id into one output; `params`: a PoolingParams. Any thread."""
        text, ids, seqs = pooling_request(self, self._seq_ids, request_id, prompt, params, arrival_time)
        self._enqueue(EngineRequest(request_id, text, ids, seqs[0].params, seqs))

    def _enqueue(self, req: EngineRequest) -> None:
        with self._intake_lock:
            if req.request_id in self._known_ids:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._known_ids.add(req.request_id)
            self._incoming.append(req)

    def add_imported_request(self, request_id: str, bundle: KVBundle, params: SamplingParams) -> None:
        """Queue the decode half of a request prefilled by another engine (engine/kv_transfer/export.py)."""
        self.kv.check(bundle, params)
        text, ids = self.prepare({"prompt_token_ids": bundle.prompt_token_ids}, params)
        seq = Sequence(next(self._seq_ids), request_id, 0, ids, params, time.time(), StopStrings(params.stop_strings))
        if params.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self._enqueue(EngineRequest(request_id, bundle.prompt, ids, params, [seq], kv_import=bundle))

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
        """Run one scheduling step (engine.core.step_phases); returns the requests that finished in it.
        Under async scheduling (engine.core.async_steps) a step's tokens are taken in the next call."""
        with self._lock:
            scheduled = phases.schedule(self)
            if scheduled.batch is None:
                if self.in_flight is None:
                    self._wait_for_grammars()
                return scheduled.finished + async_steps.drain(self)
            inputs = phases.build_inputs(scheduled)
            finished = async_steps.run(self, inputs)
            self.stats["steps"] += 1
            self.stats["batched_seqs"] += len(inputs.batch.seqs)
            self.stats["tokens"] += inputs.batch.num_tokens
            self.stats["preemptions"] = self.scheduler.num_preemptions
            return scheduled.finished + finished

    def admit_incoming(self) -> list[RequestOutput]:
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
                except Exception as exc:  # check_request built it; compiling can still fail
                    log.error("request %s: its grammar failed to compile: %s", req.request_id, exc)
                    for seq in req.seqs:
                        seq.finish_reason, seq.status = "abort", SequenceStatus.FINISHED
                    failed.append(self.request_done(req.seqs[0]))
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

    def logprob_entry(self, seq: Sequence, sample: SampleLogprobs) -> dict[int, Logprob]:
        return phases.logprob_entry(self.detokenizer.token_text if seq.params.detokenize else lambda _: None, sample)

    def check_stop(self, seq: Sequence) -> None:
        finished = self.stopping.check(seq)
        if finished is not None:
            self.finish_seq(seq, *finished)

    def finish_seq(self, seq: Sequence, reason: str, stop: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop
        self.scheduler.finish(seq)

    def request_done(self, seq: Sequence) -> RequestOutput | None:
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
        return phases.request_output(req)

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- the contract's other members (engine.core.contract) -------------------------------

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def takes_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def num_cached_blocks(self, token_ids: list[int]) -> int:
        return self.block_manager.num_cached_blocks(token_ids)

    def num_pending_imports(self) -> int:
        return len(self.kv.pending)

    def finish_startup(self) -> bool:
        """A deferred start's compiling (`pagedbatch_kernels.startup`), when the host finds the engine idle."""
        finish = getattr(self.runner, "finish_startup", None)  # the encoders' runner compiles nothing
        return bool(finish is not None and finish())

    def kv_transfer_stats(self) -> dict[str, int]:
        return dict(self.kv.stats)

    def load(self) -> EngineLoad:
        free = self.block_manager.num_free_blocks
        return EngineLoad(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            free,
            self.block_manager.num_blocks,
            self.scheduler.num_preemptions,
        )

    def stepping(self) -> AbstractContextManager:
        """The step lock: while held, no other thread steps (beam search holds it for its whole run)."""
        return self._lock

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def detach_request(self, request_id: str) -> EngineRequest:
        """Take a request out of the engine's books (its sequences are the caller's to finish)."""
        req = self.requests.pop(request_id)
        with self._intake_lock:
            self._known_ids.discard(request_id)
        return req

    def request_output(self, request: EngineRequest) -> RequestOutput:
        return phases.request_output(request)

    def kv_caches(self) -> list:
        return self.runner.kv_caches

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)
