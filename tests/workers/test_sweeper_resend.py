"""The sweeper's re-sending of queued shards whose broker messages are missing (workers.sweeper): a
queue found short is counted again CONFIRM_S later, so a message a worker has just taken (out of the
queue, its shard not yet claimed) does not send every queued shard of the job again."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from types import SimpleNamespace

import pytest

from store.models import utcnow
from workers import sweeper


@pytest.fixture
def sweep(monkeypatch):
    """Runs `_resend_lost_messages` over scripted looks at the queues; returns (re-sent, checked) shards."""
    sent, stamped, sleeps = [], [], []

    class Session:
        def execute(self, statement):
            stamped.append(statement)

    monkeypatch.setattr(sweeper, "session_scope", lambda _url: contextlib.nullcontext(Session()))
    monkeypatch.setattr(sweeper, "enqueue_shards", lambda _settings, shards: sent.extend(shards))
    monkeypatch.setattr(sweeper.time, "sleep", sleeps.append)

    def run(looks):
        """`looks`: per look at the queues, (the queued shards, the models whose queue is short)."""
        looks, short = iter(looks), set()

        def queued(_settings):
            shards, now_short = next(looks)
            short.clear()
            short.update(now_short)
            return shards

        monkeypatch.setattr(sweeper, "_queued_shards", queued)
        monkeypatch.setattr(sweeper, "queue_size", lambda _settings, model: 0 if model in short else 10**6)
        count = sweeper._resend_lost_messages(SimpleNamespace(database_url="x"), sweeper.Recovery(requeue_s=60))
        assert count == len(sent)
        return sent, stamped, sleeps

    return run


def _queued(*ids, checked=None):
    return [(shard_id, "tiny", checked) for shard_id in ids]


def test_a_queue_short_for_a_moment_sends_nothing_again(sweep):
    sent, stamped, sleeps = sweep([(_queued("a", "b"), {"tiny"}), (_queued("a", "b"), set())])
    assert sent == [] and sleeps == [sweeper.CONFIRM_S]
    assert len(stamped) == 1  # the due shards are marked checked all the same


def test_a_queue_short_twice_sends_its_due_shards_again(sweep):
    later = utcnow() + timedelta(minutes=5)
    looks = [(_queued("a", "b"), {"tiny"}), (_queued("a", "b") + _queued("c", checked=later), {"tiny"})]
    sent, _, _ = sweep(looks)
    assert sent == [("a", "tiny"), ("b", "tiny")]  # "c" was checked less than requeue_s ago


def test_a_full_queue_is_looked_at_once(sweep):
    sent, _, sleeps = sweep([(_queued("a"), set())])
    assert sent == [] and sleeps == []
