"""The engine contract: what the code that drives an engine may use, and nothing else.

`StepEngine` is what drives an engine from outside (the worker host, the prefill/decode roles,
the offline runner, the worker's metrics): requests in, `step()`, outputs out, and the numbers a
driver paces itself by. `SequenceEngine` adds what the engine's own extensions that run sequences
on its KV pool (beam search, KV export and import) use. `LLMEngine` satisfies both
(tests/test_engine_contract.py checks names and signatures); a test double that wraps one
satisfies them by delegation. Nothing outside `engine/` touches a member that is not here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler
    from engine.core.sequence import Sequence
    from engine.params.outputs import RequestOutput
    from engine.params.pooling_outputs import PoolingRequestOutput
    from engine.params.sampling_params import SamplingParams

Prompt = str | dict


@dataclass(frozen=True)
class EngineLoad:
    """The engine's state at one moment, for metrics: sequences running and waiting, KV blocks."""

    running: int
    waiting: int
    blocks_free: int
    blocks_total: int
    preemptions: int


@runtime_checkable
class StepEngine(Protocol):
    """An engine driven step by step. `add_*` may be called from any thread, also while another
    thread steps; `step` from one thread at a time."""

    tokenizer: Any  # a transformers tokenizer (loaded on first use)
    decoding_tokenizer: Any  # ids to text without transformers where the directory allows (else `tokenizer`)
    stats: dict  # counters since start: "tokens" and "batched_seqs" stepped, among others
    max_model_len: int

    @property
    def max_num_seqs(self) -> int: ...  # sequences one step may run

    @property
    def block_size(self) -> int: ...  # tokens per KV block

    @property
    def takes_priority(self) -> bool: ...  # scheduling_policy="priority": add_request's priority orders

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> None: ...

    def prepare_request(self, prompt: Prompt, params: SamplingParams) -> Any: ...  # checked and tokenized

    def add_prepared_request(
        self, request_id, prompt, params, prepared, arrival_time=None, priority=0, lora_request=None
    ) -> None: ...  # add_request, given what prepare_request gave

    def add_pooling_request(
        self, request_id: str, prompt: Prompt | list[Prompt], params=None, arrival_time: float | None = None
    ) -> None: ...

    def add_imported_request(self, request_id: str, bundle: Any, params: SamplingParams) -> None: ...  # KVBundle

    def abort_request(self, request_id: str) -> bool: ...

    def pause_requests(self, request_ids: Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput | PoolingRequestOutput]: ...

    def num_free_blocks(self) -> int: ...

    def num_cached_blocks(self, token_ids: list[int]) -> int: ...  # leading full blocks in the prefix cache

    def num_pending_imports(self) -> int: ...  # decode halves waiting for room in the pool

    def finish_startup(self) -> bool: ...

    def kv_transfer_stats(self) -> dict[str, int]: ...

    def load(self) -> EngineLoad: ...


@runtime_checkable
class SequenceEngine(StepEngine, Protocol):
    """What beam search and KV export/import use: sequences on the engine's scheduler and pool."""

    scheduler: Scheduler
    block_manager: BlockManager
    model_config: Any  # engine.hf.config.ModelConfig or EncoderConfig
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    eos_token_id: int | None

    def stepping(self) -> AbstractContextManager: ...  # holds the step lock: no other thread steps

    def new_seq_id(self) -> int: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def check_stop(self, seq: Sequence) -> None: ...  # finishes `seq` if its last token stops it

    def request_done(self, seq: Sequence) -> RequestOutput | PoolingRequestOutput | None: ...

    def detach_request(self, request_id: str) -> Any: ...  # the request leaves the engine, blocks untouched

    def request_output(self, request: Any) -> RequestOutput: ...

    def kv_caches(self) -> list[tuple[Any, Any]]: ...  # per layer (K, V) pools on the device

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...  # (src, dst) block copies in every layer


def missing_members(engine: object, contract: type = StepEngine) -> list[str]:
    """The members of `contract` that `engine` lacks (empty: it satisfies the contract by name)."""
    names = [n for n in dir(contract) if not n.startswith("_")]
    names += [n for c in contract.__mro__ for n in vars(c).get("__annotations__", {}) if not n.startswith("_")]
    return sorted({n for n in names if not _has(engine, n)})


def _has(engine: object, name: str) -> bool:
    """hasattr without running a property where one is found (the engine's `tokenizer` loads transformers);
    names served by `__getattr__` alone are still looked up the usual way."""
    try:
        inspect.getattr_static(engine, name)
        return True
    except AttributeError:
        return hasattr(engine, name)


def require_step_engine(engine: object) -> StepEngine:
    """`engine`, if it offers every member of `StepEngine`; else a TypeError naming what it lacks."""
    missing = missing_members(engine)
    if missing:
        raise TypeError(
            f"{type(engine).__name__} is not a StepEngine (engine.core.contract): it lacks {', '.join(missing)}"
        )
    return engine
