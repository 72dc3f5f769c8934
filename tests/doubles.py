"""Test engines for worker processes, given to `pagedbatch worker --engine-factory tests.doubles:NAME`.

A factory takes `engine.LLMEngine`'s keyword arguments and returns an engine. A worker process gets
its parameters from these environment variables, which only this module reads.
"""

from __future__ import annotations

import os
import signal
import time

from engine import LLMEngine

POISON_ENV = "PAGEDBATCH_TEST_POISON"  # a prompt containing this text makes every step raise
STEP_DELAY_ENV = "PAGEDBATCH_TEST_STEP_DELAY_S"  # every step takes at least this long
KILL_ENV = "PAGEDBATCH_TEST_KILL"  # a prompt containing this text SIGKILLs the worker process


class PoisonedEngine:
    """While a request whose prompt contains `marker` is in the engine, `step` raises, as a request
    that crashes the model would."""

    def __init__(self, engine, marker: str):
        self._engine = engine
        self._marker = marker
        self._poisoned: set[str] = set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params=None):
        self._engine.add_request(request_id, prompt, params)
        self._watch(request_id, prompt)

    def add_prepared_request(
        self, request_id, prompt, params, prepared, arrival_time=None, priority=0, lora_request=None
    ):
        self._engine.add_prepared_request(request_id, prompt, params, prepared, arrival_time, priority, lora_request)
        self._watch(request_id, prompt)

    def _watch(self, request_id, prompt):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        text = self._engine.tokenizer.decode(ids) if ids is not None else str(prompt)
        if self._marker in text:
            self._poisoned.add(request_id)

    def abort_request(self, request_id):
        self._poisoned.discard(request_id)
        return self._engine.abort_request(request_id)

    def step(self):
        if self._poisoned:
            raise RuntimeError(f"test fault: a poisoned request is in the batch ({len(self._poisoned)})")
        return self._engine.step()


class KillingEngine(PoisonedEngine):
    """While a request whose prompt contains `marker` is in the engine, `step` SIGKILLs its own process,
    as a request that crashes the worker (out of memory, a segfault in a kernel) would."""

    def step(self):
        if self._poisoned:
            os.kill(os.getpid(), signal.SIGKILL)
        return self._engine.step()


class SlowEngine:
    """Every step takes at least `delay` seconds, so that a shard reliably outlasts a short broker
    visibility timeout whatever the machine's speed."""

    def __init__(self, engine, delay: float):
        self._engine = engine
        self._delay = delay

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(self._delay)
        return self._engine.step()


def poisoned_engine(**engine_kwargs) -> PoisonedEngine:
    """The engine factory of a worker whose steps fail while a prompt contains $PAGEDBATCH_TEST_POISON."""
    return PoisonedEngine(LLMEngine(**engine_kwargs), os.environ[POISON_ENV])


def slow_engine(**engine_kwargs) -> SlowEngine:
    """The engine factory of a worker whose steps take at least $PAGEDBATCH_TEST_STEP_DELAY_S seconds."""
    return SlowEngine(LLMEngine(**engine_kwargs), float(os.environ[STEP_DELAY_ENV]))


def killing_engine(**engine_kwargs) -> KillingEngine:
    """The engine factory of a worker that SIGKILLs itself while a prompt contains $PAGEDBATCH_TEST_KILL."""
    return KillingEngine(LLMEngine(**engine_kwargs), os.environ[KILL_ENV])
