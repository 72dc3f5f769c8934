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


def test_the_host_admits_a_tenants_requests_by_job_priority(tiny_model, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "1")
    host = EngineHost(lambda: LLMEngine(model=str(tiny_model("qwen3")), max_num_seqs=1))  # one at a time
    try:
        order: list[str] = []
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        def submit(tag: str, priority: int, count: int = 2):
            batch = [(f"{tag}{i}", {"prompt_token_ids": [1, 2, 3 + i]}, params) for i in range(count)]
            futures = host.submit_many(batch, "a", weight=2, priority=priority)
            for future in futures:
                future.add_done_callback(lambda f: order.append(f.result().request_id))
            return futures

        futures = submit("first", -100, 1) + submit("late", 5) + submit("urgent", -1) + submit("plain", 0)
        for future in futures:
            future.result(timeout=120)
        wait_until(lambda: len(order) == len(futures), 10, what="the last done-callback")  # runs after result()
        assert order == ["first0", "urgent0", "urgent1", "plain0", "plain1", "late0", "late1"]
    finally:
        host.close()
