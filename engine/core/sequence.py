"""One generation stream: its tokens, its place in the KV pool, and its state."""

from __future__ import annotations

import copy
import enum
import time

from engine.core.stop_strings import StopStrings
from engine.params.outputs import Logprob
from engine.params.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request with n > 1 becomes n sequences sharing the prompt (and, through the
    prefix cache, its KV blocks)."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
        stop_strings: StopStrings | None = None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_dropped_blocks = 0  # leading blocks released behind a sliding window (ids kept, unread)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # Async scheduling (engine.core.async_steps): placeholders ending `token_ids` for tokens sampled on the
        # device but not yet read, and this sequence's row among the in-flight step's sampled tokens.
        self.num_pending = 0
        self.pending_row = 0
        self.reads_own_tokens: bool | None = None  # whether its steps must read tokens at once (memo)
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks (memo)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Entry i: prompt token i's logprobs (the first has none); filled chunk by chunk.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.bad_words_token_ids: list[list[int]] | None = None  # the engine tokenizes params.bad_words
        self.output_text = ""
        # a request's n sequences share one index of its stop strings
        self.stop_strings = stop_strings if stop_strings is not None else StopStrings(params.stop_strings)
        self.detok_offsets: tuple[int, int] | None = None  # owned by the detokenizer
        self.grammar = None  # its xgrammar matcher under structured outputs (engine.sampling.structured_outputs)
        self.generator = None  # a seeded request's own torch.Generator, made on first use
        self.arrival = arrival or time.time()
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.priority = 0  # the request's priority under scheduling_policy="priority": lower runs first
        self.pooling = None  # an embedding request's engine.pooling.requests.PoolingState
        self.mm = None  # its images (engine.multimodal.processor.MultiModalPrompt), kept through preemption
        self.lora_id = 0  # its LoRA adapter's lora_int_id; 0: the base model
        # Set by beam search (engine.beam.runner): called with (seq, logprob entry) where the
        # engine would append a sampled token; the search appends the tokens it picks.
        self.on_logprobs = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def fork(self, seq_id: int) -> Sequence:
        """A copy with this sequence's tokens and state but no blocks (a beam search's child
        beam; BlockManager.fork gives it its parent's KV)."""
        child = copy.copy(self)
        child.seq_id = seq_id
        child.token_ids = list(self.token_ids)
        child.block_table = []
        child.block_hashes = list(self.block_hashes)
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        return child

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()
