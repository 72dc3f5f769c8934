"""Fair share across tenants in a worker (issue 12, finding 4): a small job of tenant B enters the engine
beside tenant A's large one instead of waiting behind it; weights skew the share."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLMEngine, SamplingParams
from tests.helpers import wait_until
from workers.host.engine_host import EngineHost
from workers.host.fair_share import FairShare


def _admit_all(fair: FairShare, running: Counter) -> list[str]:
    admitted = []
    while (picked := fair.next(running, sum(running.values()))) is not None:
        running[picked[0]] += 1
        admitted.append(picked[0])
    return admitted


def test_a_tenant_alone_borrows_the_reserve_and_gives_it_back_to_a_newcomer():
    fair = FairShare(capacity=8, reserve=2)
    for i in range(100):
        fair.push("a", f"a{i}")
    running = Counter()
    assert _admit_all(fair, running) == ["a"] * 8  # alone: the whole engine
    assert fair.to_reclaim(running, 8) is None  # nobody waits for the reserve
    for i in range(4):
        fair.push("b", f"b{i}")
    assert _admit_all(fair, running) == []  # full
    assert fair.to_reclaim(running, 8) == ("a", 2)  # the two borrowed places go back at once
    running["a"] -= 2
    fair.push("a", "a6", front=True)
    fair.push("a", "a7", front=True)
    assert _admit_all(fair, running) == ["b", "b"]
    assert fair.to_reclaim(running, 8) is None  # b holds its reserve now: a borrows nothing more
    running["a"] -= 2  # two of A's finish: B, holding fewer, comes first
    assert _admit_all(fair, running) == ["b", "b"]
    running["b"] -= 4  # B is done: A alone again borrows the reserve, its given-back requests first
    picked = []
    while (found := fair.next(running, sum(running.values()))) is not None:
        running[found[0]] += 1
        picked.append(found[1])
    assert picked[:2] == ["a7", "a6"] and len(picked) == 4 and sum(running.values()) == 8
    assert fair.waiting() == 90


def test_a_host_that_cannot_give_places_back_lends_none():
    fair = FairShare(capacity=8, reserve=2)
    for i in range(10):
        fair.push("a", f"a{i}")
    running = Counter()
    while (picked := fair.next(running, sum(running.values()), lend=False)) is not None:
        running[picked[0]] += 1
    assert running["a"] == 6  # the reserve stays free (a disaggregated decode worker's remote prefills)
    fair.push("b", "b0")
    assert fair.next(running, 6, lend=False)[0] == "b"


def test_a_newcomer_with_one_request_takes_back_one_place_and_a_reserve_of_zero_none():
    fair = FairShare(capacity=8, reserve=2)
    running = Counter(a=8)
    fair.push("b", "b0")
    assert fair.to_reclaim(running, 8) == ("a", 1)
    assert FairShare(capacity=8, reserve=0).to_reclaim(Counter(a=8), 8) is None
    assert FairShare(capacity=8, reserve=2, enabled=False).to_reclaim(running, 8) is None
    assert fair.to_reclaim(Counter(a=6, c=2), 8) is None  # a holds no borrowed place


def test_weights_skew_the_share():
    fair = FairShare(capacity=40, reserve=0)
    for i in range(100):
        fair.push("a", f"a{i}", weight=3)  # the tenant's weight, as its shards carry it from the database
        fair.push("b", f"b{i}")
    assert Counter(_admit_all(fair, Counter())) == {"a": 30, "b": 10}
    for bad in (0, -1, float("nan"), float("inf"), "2", True):
        with pytest.raises(ValueError, match="a tenant's weight is a positive number"):
            fair.push("a", "x", weight=bad)


def test_a_weight_changes_with_the_next_shard_and_is_forgotten_when_the_tenant_is_idle():
    fair = FairShare(capacity=40, reserve=0)
    fair.push("a", "a0", weight=2)
    fair.push("a", "a1")  # no weight given: the tenant keeps 2
    assert fair.weights == {"a": 2.0}
    fair.push("a", "a2", weight=0.5)
    assert fair.weights == {"a": 0.5}
    fair.push("b", "b0", weight=4)
    running = Counter()
    _admit_all(fair, running)
    assert fair.weights == {"a": 0.5, "b": 4.0}  # both still running
    running["b"] = 0  # B's request finished; A's queue empties next: B's weight is dropped, A's kept
    fair.push("a", "a3")
    _admit_all(fair, running)
    assert fair.weights == {"a": 0.5}


def test_priority_orders_a_tenants_queue_but_not_across_tenants():
    fair = FairShare(capacity=100, reserve=0)
    for i, priority in enumerate([0, 5, -3, 0, 5, -3]):
        fair.push("a", f"a{i}:{priority}", priority=priority)
    fair.push("b", "b0:100", priority=100)  # B's worst priority still gets B's share
    fair.push("b", "b1:-100", priority=-100)
    order = []
    running = Counter()
    while (picked := fair.next(running, sum(running.values()))) is not None:
        running[picked[0]] += 1
        order.append(picked[1])
    assert [r for r in order if r.startswith("a")] == ["a2:-3", "a5:-3", "a0:0", "a3:0", "a1:5", "a4:5"]
    assert [r for r in order if r.startswith("b")] == ["b1:-100", "b0:100"]
    assert order.index("b0:100") < order.index("a0:0")  # across tenants, the shares rule: B holds less


def test_earliest_deadline_first_within_a_priority():
    """A job's completion window orders its tenant's queue after priority: the earliest deadline first, then
    the oldest; no deadline comes last."""
    fair = FairShare(capacity=100, reserve=0)
    fair.push("a", "late", deadline=2000.0)
    fair.push("a", "none")
    fair.push("a", "soon", deadline=1000.0)
    fair.push("a", "urgent-but-low", priority=1, deadline=10.0)
    fair.push("a", "soon-2", deadline=1000.0)
    order = []
    running = Counter()
    while (picked := fair.next(running, sum(running.values()))) is not None:
        running[picked[0]] += 1
        order.append(picked[1])
    assert order == ["soon", "soon-2", "late", "none", "urgent-but-low"]


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


def test_given_back_requests_run_again_to_the_same_tokens(tiny_model, monkeypatch):
    """A tenant alone fills the engine (the reserve too); a newcomer takes the borrowed places back at once,
    and the requests that gave them up start again from their prompt: every output complete and the same."""
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "1")
    monkeypatch.setenv("PAGEDBATCH_FAIR_RESERVE", "2")
    path = str(tiny_model("qwen3"))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    a_requests = [(f"a{i}", {"prompt_token_ids": [1, 2, 3 + i]}, long) for i in range(10)]
    host = EngineHost(lambda: LLMEngine(model=path, max_num_seqs=8))
    stepping: list[int] = []  # requests in each step
    counted = host._fair.stepped
    host._fair.stepped = lambda seconds, paused, count=0, prompts=0: (
        stepping.append(count),
        counted(seconds, paused, count, prompts),
    )
    try:
        alone = [f.result(timeout=300).outputs[0].token_ids for f in host.submit_many(a_requests, "a")]
        assert max(stepping) == 8  # alone: all 8 places, the reserve too
        stepping.clear()
        futures = host.submit_many([(f"x{i}", *a[1:]) for i, a in enumerate(a_requests)], "a")
        wait_until(lambda: 8 in stepping, timeout=60, poll=0.002)
        order: list[str] = []
        b = host.submit_many([(f"b{i}", {"prompt_token_ids": [4, 5, 6 + i]}, short) for i in range(2)], "b")
        for future in futures + b:
            future.add_done_callback(lambda f: order.append(f.result().request_id))
        shared = [f.result(timeout=300).outputs[0].token_ids for f in futures]
        for future in b:
            future.result(timeout=300)
    finally:
        host.close()
    assert order[:2] in (["b0", "b1"], ["b1", "b0"])  # given the borrowed places at once, done first
    assert shared == alone and all(len(tokens) == 200 for tokens in shared)
