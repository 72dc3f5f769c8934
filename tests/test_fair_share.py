"""Fair share across tenants in a worker (issue 12, finding 4): a small job of tenant B enters the engine
beside tenant A's large one instead of waiting behind it; weights skew the share."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLMEngine, SamplingParams
from workers.engine_host import EngineHost
from workers.fair_share import FairShare, parse_weights


def _admit_all(fair: FairShare, running: Counter) -> list[str]:
    admitted = []
    while (picked := fair.next(running, sum(running.values()))) is not None:
        running[picked[0]] += 1
        admitted.append(picked[0])
    return admitted


def test_a_tenant_alone_leaves_the_reserve_and_a_newcomer_takes_it():
    fair = FairShare(capacity=8, reserve=2)
    for i in range(100):
        fair.push("a", f"a{i}")
    running = Counter()
    assert _admit_all(fair, running) == ["a"] * 6
    for i in range(4):
        fair.push("b", f"b{i}")
    assert _admit_all(fair, running) == ["b", "b"]  # at once, in the reserve
    running["a"] -= 2  # two of A's finish: B, holding fewer, comes first
    assert _admit_all(fair, running) == ["b", "b"]
    assert fair.waiting() == 94


def test_weights_skew_the_share():
    fair = FairShare(capacity=40, reserve=0, weights=parse_weights("a=3,b=1"))
    for i in range(100):
        fair.push("a", f"a{i}")
        fair.push("b", f"b{i}")
    assert Counter(_admit_all(fair, Counter())) == {"a": 30, "b": 10}
    with pytest.raises(ValueError, match="TENANT=POSITIVE_NUMBER"):
        parse_weights("a=0")


def _finish_order(path: str, fair_share: bool, monkeypatch) -> list[str]:
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "1" if fair_share else "0")
    host = EngineHost(lambda: LLMEngine(model=path, max_num_seqs=8))
    try:
        order: list[str] = []
        long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        futures = host.submit_many([(f"a{i}", {"prompt_token_ids": [1, 2, 3 + i]}, long) for i in range(48)], "a")
        futures += host.submit_many([(f"b{i}", {"prompt_token_ids": [4, 5, 6 + i]}, short) for i in range(2)], "b")
        for future in futures:
            future.add_done_callback(lambda f: order.append(f.result().request_id))
        for future in futures:
            future.result(timeout=300)
        return order
    finally:
        host.close()


def test_a_small_job_of_another_tenant_is_not_stuck_behind_a_large_one(tiny_model, monkeypatch):
    path = str(tiny_model("qwen3"))
    fifo = _finish_order(path, False, monkeypatch)
    fair = _finish_order(path, True, monkeypatch)
    assert max(fifo.index("b0"), fifo.index("b1")) >= 40  # first come first served: behind all of A's
    assert max(fair.index("b0"), fair.index("b1")) < 2  # fair share: in the reserve at once, done first
