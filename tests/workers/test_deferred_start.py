"""A worker's deferred start (`pagedbatch_kernels.startup`): the engine loads without compiling, serves at
once (eagerly, the same tokens as transformers), and compiles its kernels the first time it is idle for
STARTUP_IDLE_S, between requests; then serves the same tokens compiled."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.runner.model_runner import ModelRunner
from pagedbatch_kernels import startup
from tests.helpers import make_prompts, reference
from workers.host import engine_host
from workers.host.engine_host import EngineHost


def _run(host, prompts, max_tokens, tag):
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    futures = host.submit_many(
        [(f"{tag}{i}", {"prompt_token_ids": p}, g) for i, (p, g) in enumerate(zip(prompts, greedy))]
    )
    return [list(f.result(timeout=600).outputs[0].token_ids) for f in futures]


def test_deferred_start_serves_first_and_compiles_when_idle(tiny_model, monkeypatch):
    monkeypatch.setenv(startup.ENV, "deferred")
    monkeypatch.setattr(engine_host, "STARTUP_IDLE_S", 0.5)
    compiles = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(fn) or real_compile(fn, **kw))
    finished = []  # what each ModelRunner.finish_startup call did (kernels compiled earlier in this process stay
    real_finish = ModelRunner.finish_startup  # compiled, so torch.compile calls alone cannot tell)
    monkeypatch.setattr(ModelRunner, "finish_startup", lambda self: finished.append(real_finish(self)) or finished[-1])
    path = tiny_model("qwen3")
    prompts, max_tokens = make_prompts(seed=5, count=8)
    expected = reference(path, prompts, max_tokens)
    host = EngineHost(lambda: LLMEngine(model=str(path), max_num_batched_tokens=256))
    try:
        assert compiles == [] and startup.quick()  # loaded, nothing compiled
        assert _run(host, prompts, max_tokens, "a") == expected  # served eagerly
        deadline = time.monotonic() + 600
        while startup.mode() != "full" or host._startup_finished is False:
            assert time.monotonic() < deadline, "the idle engine never finished its start"
            time.sleep(0.2)
        assert _run(host, prompts, max_tokens, "b") == expected  # after the warm-up ran (once)
        assert finished == [True], "the idle engine finished its start once"
    finally:
        host.close()


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_other_starts_have_nothing_left_to_do(mode, monkeypatch):
    monkeypatch.setenv(startup.ENV, mode)

    assert ModelRunner.finish_startup(object.__new__(ModelRunner)) is False
    assert startup.mode() == mode


class StartupLoadingEngine:
    """An engine whose deferred start leaves long-lived objects behind, as the kernel compiler's modules do."""

    def __init__(self, path: str):
        self._engine = LLMEngine(model=path, max_num_seqs=4)
        self.loaded: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def finish_startup(self) -> bool:
        self.loaded = [[i] for i in range(5000)]
        return True


def _unfrozen(objects) -> int:
    """How many of `objects` the collector still walks (gc.get_objects leaves out the frozen ones)."""
    walked = {id(o) for o in gc.get_objects()}
    return sum(id(o) in walked for o in objects)


@pytest.mark.parametrize("froze_at_load", [True, False])
def test_what_the_idle_start_loaded_is_frozen_where_the_process_froze_its_heap(froze_at_load, tiny_model, monkeypatch):
    monkeypatch.setattr(engine_host, "STARTUP_IDLE_S", 0.1)
    path = str(tiny_model("qwen3"))
    assert gc.get_freeze_count() == 0
    if froze_at_load:
        gc.freeze()  # as a worker does once its engine is loaded
    host = EngineHost(lambda: StartupLoadingEngine(path))
    try:
        deadline = time.monotonic() + 60
        while not (host.engine.loaded and host._startup_finished):
            assert time.monotonic() < deadline, "the idle engine never finished its start"
            time.sleep(0.05)
        if froze_at_load:
            while _unfrozen(host.engine.loaded):
                assert time.monotonic() < deadline, "what the start loaded was never frozen"
                time.sleep(0.1)
        else:  # a process that manages its own heap (a notebook, `pagedbatch run`): nothing frozen behind its back
            time.sleep(0.5)
            assert gc.get_freeze_count() == 0
            assert _unfrozen(host.engine.loaded) == len(host.engine.loaded)
    finally:
        host.close()
        gc.unfreeze()
