"""EngineHost: the worker's engine driven by one thread, with per-request futures."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from engine import LLMEngine, SamplingParams
from tests.helpers import assert_pool_free, engine_greedy
from workers.host.engine_host import EngineHost
from workers.process import load_engine_factory


class ThreadRecordingEngine:
    """Wraps an engine and records which threads built it and stepped it."""

    def __init__(self, path: str):
        self.built_in = threading.current_thread().name
        self.stepped_in: set[str] = set()
        self._engine = LLMEngine(model=path, max_num_seqs=8)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self.stepped_in.add(threading.current_thread().name)
        return self._engine.step()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_load_builds_and_steps_the_engine_in_the_loop_thread_only(tiny_model):
    path = str(tiny_model("qwen3"))
    host = EngineHost(lambda: ThreadRecordingEngine(path))
    try:
        requests = [(f"r{i}", {"prompt_token_ids": [1 + i, 2, 3 + i]}, _greedy(3 + i % 4)) for i in range(12)]
        futures = host.submit_many(requests)
        outputs = [f.result(timeout=120) for f in futures]
        engine = host.engine
        assert engine.built_in == "engine-loop" and engine.stepped_in == {"engine-loop"}
        assert threading.current_thread().name != "engine-loop"

        expected = engine_greedy(path, requests)
        assert {o.request_id: o.outputs[0].token_ids for o in outputs} == expected
        assert host.pending() == 0
        assert_pool_free(engine._engine)
    finally:
        host.close()


def test_a_failed_load_is_raised_to_the_caller(tmp_path):
    with pytest.raises(Exception) as excinfo:
        EngineHost(lambda: LLMEngine(model=str(tmp_path / "no-such-model")))
    assert "no-such-model" in str(excinfo.value)


def test_bad_request_fails_alone_and_abort_resolves_none(tiny_model):
    host = EngineHost(lambda: LLMEngine(model=str(tiny_model("qwen3")), max_num_seqs=4))
    try:
        good, bad, aborted = host.submit_many(
            [
                ("good", {"prompt_token_ids": [1, 2, 3]}, _greedy(4)),
                ("bad", {"prompt_token_ids": [1, 10**9]}, _greedy(4)),
                ("gone", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=10_000, ignore_eos=True)),
            ]
        )
        assert host.abort(["gone"]) == 1
        assert aborted.result(timeout=60) is None
        with pytest.raises(ValueError, match="out of vocabulary"):
            bad.result(timeout=60)
        assert len(good.result(timeout=120).outputs[0].token_ids) == 4
        concurrent.futures.wait([good, bad, aborted])
        assert host.pending() == 0
    finally:
        host.close()


def test_engine_factory_hook_resolves_module_callable():
    from tests import doubles

    assert load_engine_factory(None) is LLMEngine
    assert load_engine_factory("tests.doubles:slow_engine") is doubles.slow_engine
    assert load_engine_factory("tests.doubles:SlowEngine.step") is doubles.SlowEngine.step
    for bad in ("tests.doubles", "tests.doubles:", ":slow_engine"):
        with pytest.raises(ValueError, match="module:callable"):
            load_engine_factory(bad)


def test_a_wrapped_engine_runs_in_the_host(tiny_model, monkeypatch):
    """What a worker does with --engine-factory tests.doubles:poisoned_engine: the poisoned request fails
    alone and every other one finishes."""
    from tests.doubles import POISON_ENV, poisoned_engine

    monkeypatch.setenv(POISON_ENV, "POISON")
    factory = load_engine_factory("tests.doubles:poisoned_engine")
    assert factory is poisoned_engine
    host = EngineHost(lambda: factory(model=str(tiny_model("qwen3")), max_num_seqs=4))
    try:
        tokenizer = host.tokenizer
        prompts = {"ok1": "hello there", "bad": "a POISON pill", "ok2": "good morning"}
        futures = host.submit_many(
            [(rid, {"prompt_token_ids": tokenizer.encode(text)}, _greedy(3)) for rid, text in prompts.items()]
        )
        results = dict(zip(prompts, futures, strict=True))
        with pytest.raises(RuntimeError, match="poisoned"):
            results["bad"].result(timeout=120)
        assert len(results["ok1"].result(timeout=120).outputs[0].token_ids) == 3
        assert len(results["ok2"].result(timeout=120).outputs[0].token_ids) == 3
    finally:
        host.close()
