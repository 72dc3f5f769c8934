"""What a worker does with SIGTERM's shutdown signal (`workers.tasks.on_shutdown`), without processes: with a
drain timeout the running shards go on and new ones go back unstarted, until the deadline or a second signal;
without one, or on a cold shutdown, everything in flight is aborted at once. tests/faults/test_workers.py does
the same to real worker processes."""

import threading
import time

import pytest

from tests.helpers import wait_until
from workers import shard_runner, tasks

IN_FLIGHT = {"job.00000": ["job.00000/1/0", "job.00000/1/1"], "job.00001": ["job.00001/1/0"]}


class Host:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        return len(request_ids)


@pytest.fixture
def worker(monkeypatch):
    """This process's worker state with two shards in the engine; `worker(drain_s)` configures it."""
    host = Host()
    monkeypatch.setattr(shard_runner, "closing", threading.Event())
    monkeypatch.setattr(shard_runner, "draining", threading.Event())
    monkeypatch.setattr(shard_runner, "_in_flight", {k: list(v) for k, v in IN_FLIGHT.items()})
    state: dict = {}
    monkeypatch.setattr(tasks, "_state", state)

    def configure(drain_s: float) -> Host:
        state.update(host=host, drain_s=drain_s)
        return host

    yield configure
    timer = state.get("drain_timer")
    if timer is not None:
        timer.cancel()


ALL = [rid for ids in IN_FLIGHT.values() for rid in ids]


def test_without_a_drain_timeout_the_running_shards_are_handed_back_at_once(worker):
    host = worker(0)
    tasks.on_shutdown("Warm")
    assert host.aborted == ALL and shard_runner.draining.is_set()


def test_with_a_drain_timeout_running_shards_go_on_until_the_deadline(worker):
    host = worker(0.5)
    t0 = time.monotonic()
    tasks.on_shutdown("Warm")
    assert host.aborted == [] and not shard_runner.draining.is_set()
    # a shard delivered now goes back to the queue before it is claimed (no database, engine or watcher needed)
    assert shard_runner.run_shard(None, host, None, "job.00002") == shard_runner.RELEASED
    wait_until(lambda: host.aborted, 10, 0.02, "the drain to abort what is left")
    assert host.aborted == ALL and time.monotonic() - t0 >= 0.5
    assert shard_runner.draining.is_set()


@pytest.mark.parametrize("second", ["Warm", "Cold"])
def test_a_second_signal_during_the_drain_hands_back_at_once(worker, second):
    host = worker(60)
    tasks.on_shutdown("Warm")
    assert host.aborted == []
    tasks.on_shutdown(second)
    assert host.aborted == ALL and "drain_timer" not in tasks._state


def test_a_cold_shutdown_never_waits(worker):
    host = worker(60)
    tasks.on_shutdown("Cold")
    assert host.aborted == ALL and "drain_timer" not in tasks._state
