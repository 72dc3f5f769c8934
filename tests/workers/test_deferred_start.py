"""A worker's deferred start (`pagedbatch_kernels.startup`): the engine loads without compiling, serves at
once (eagerly, the same tokens as transformers), and compiles its kernels the first time it is idle for
STARTUP_IDLE_S, between requests; then serves the same tokens compiled."""

from __future__ import annotations

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
