"""The webhook sender's pool: an endpoint that never answers holds one attempt, not the others (no database:
the store calls are replaced by an in-memory queue of due deliveries)."""

import threading
from types import SimpleNamespace

import pytest

from store.callbacks.webhook_events import Answer, new_secret
from store.settings import Settings
from workers import webhook_sender


@pytest.fixture
def deliveries(monkeypatch):
    """Two due deliveries, the first to an endpoint whose answer waits until `release` is set."""
    due = [
        (SimpleNamespace(id="whd_slow", event_type="batch.completed", event_id="evt_1", body="{}"),
         SimpleNamespace(url="http://slow.example/hook")),
        (SimpleNamespace(id="whd_fast", event_type="batch.completed", event_id="evt_2", body="{}"),
         SimpleNamespace(url="http://fast.example/hook")),
    ]  # fmt: skip
    state = SimpleNamespace(release=threading.Event(), recorded={}, fast_recorded=threading.Event(), claims=[])

    def due_deliveries(settings, lease_s, limit):
        state.claims.append(limit)
        claimed, due[:] = due[:limit], due[limit:]
        return claimed

    def post(url, body, headers, timeout):
        if "slow" in url:
            state.release.wait(30)
        return Answer(200, None)

    def record_attempt(settings, delivery_id, status_code, error):
        state.recorded[delivery_id] = status_code
        if delivery_id == "whd_fast":
            state.fast_recorded.set()

    monkeypatch.setattr(webhook_sender, "announce_ended_jobs", lambda settings: 0)
    monkeypatch.setattr(webhook_sender, "due_deliveries", due_deliveries)
    monkeypatch.setattr(webhook_sender, "post", post)
    monkeypatch.setattr(webhook_sender, "record_attempt", record_attempt)
    monkeypatch.setattr(webhook_sender, "check_url", lambda settings, url: None)
    monkeypatch.setattr(webhook_sender, "signing_secrets", lambda endpoint: [new_secret()])
    yield state
    state.release.set()


def test_an_endpoint_that_never_answers_does_not_hold_up_the_others(deliveries):
    sender = webhook_sender.WebhookSender(Settings(webhook_poll_s=0.05, webhook_concurrency=4))
    try:
        assert deliveries.fast_recorded.wait(20), "the second delivery waited behind the first endpoint's answer"
        assert deliveries.recorded == {"whd_fast": 200}  # the slow one is still in flight
        deliveries.release.set()
        assert _wait(lambda: "whd_slow" in deliveries.recorded)
    finally:
        sender.close()


def test_no_more_attempts_are_claimed_than_the_pool_has_room_for(deliveries):
    sender = webhook_sender.WebhookSender(Settings(webhook_poll_s=0.05, webhook_concurrency=1))
    try:
        assert _wait(lambda: deliveries.claims)
        assert not deliveries.fast_recorded.wait(0.5)  # one thread, held by the slow endpoint
        deliveries.release.set()
        assert deliveries.fast_recorded.wait(20)  # sent once the thread is free
        assert set(deliveries.claims) == {1}  # never claimed (leased) more than it could send
    finally:
        sender.close()


def _wait(condition, timeout: float = 20.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if condition():
            return True
        done.wait(0.05)
    return bool(condition())
