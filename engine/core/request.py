"""A request as the engine holds it between `add_request` and its last output."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from engine.core.sequence import Sequence
from engine.kv_transfer.export import KVBundle
from engine.params.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One request inside the engine: its prompt, parameters and sequences (n of them, or beams)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    kv_import: KVBundle | None = None  # a decode half, until its KV is in the pool
    grammar: Future | None = None  # the compiled grammar under structured outputs
