"""A worker's measured step rates (published by its heartbeat) and the run time a quote derives from them."""

from __future__ import annotations

import random

import pytest

from store.lifecycle.quotes import Work, _fit, _seconds_on
from workers.host.step_rates import StepRates

STEP_S, TOKEN_S = 0.004, 2e-5  # the engine double's costs


class FakeEngine:
    block_size, max_num_seqs = 16, 64

    def __init__(self, blocks: int = 100):
        self.stats = {"tokens": 0, "batched_seqs": 0}
        self.blocks = blocks

    def step(self, prefill: int, decodes: int) -> float:
        self.stats["tokens"] += prefill + decodes
        self.stats["batched_seqs"] += decodes
        return STEP_S + TOKEN_S * (prefill + decodes)

    def num_free_blocks(self) -> int:
        return self.blocks


def _measured(steps: int = 300) -> dict:
    rng, engine, rates = random.Random(0), FakeEngine(), StepRates()
    for _ in range(steps):
        prefill, decodes = rng.choice([0, 0, 512, 2048]), rng.randrange(1, 40)
        rates.observe(engine, engine.step(prefill, decodes))
    return rates.snapshot()


def test_the_fit_recovers_the_step_costs():
    step, per_token = _fit(_measured())
    assert step == pytest.approx(STEP_S, rel=1e-3)
    assert per_token == pytest.approx(TOKEN_S, rel=1e-3)
    assert _fit(StepRates().snapshot()) is None  # nothing measured: no estimate


def test_run_time_counts_uncached_prompt_and_the_sequences_the_pool_holds():
    rates = _measured()
    assert rates["pool"] == {"block_size": 16, "max_num_seqs": 64, "blocks": 100}
    # 10 lines of 64 prompt + 16 completion tokens: 5 blocks each, 20 fit in 100 blocks: all 10 at once
    work = Work(lines=10, prompt_tokens=640, cached_tokens=0, completion_tokens=160)
    expected = STEP_S * 16 + TOKEN_S * (640 + 160)
    assert _seconds_on(rates, work) == pytest.approx(expected, rel=1e-3)
    cached = Work(lines=10, prompt_tokens=640, cached_tokens=480, completion_tokens=160)
    assert _seconds_on(rates, cached) == pytest.approx(expected - TOKEN_S * 480, rel=1e-3)
    crowded = Work(lines=100, prompt_tokens=6400, cached_tokens=0, completion_tokens=1600)  # 20 at once
    assert _seconds_on(rates, crowded) == pytest.approx(STEP_S * 1600 / 20 + TOKEN_S * 8000, rel=1e-3)
