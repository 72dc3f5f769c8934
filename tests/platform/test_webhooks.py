"""Webhooks as OpenAI shapes them: endpoints managed with the official client, batch events delivered by the
worker to a local receiver, signed per Standard Webhooks and verified by `client.webhooks.unwrap`; tampered
and replayed events refused by the client's check; retries with backoff; loopback and private URLs refused."""

import io
import threading
import time
import types
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import update

from pagedbatch.cli import main
from store.db import session_scope
from store.lifecycle.cancel import expire_job
from store.models import Job, utcnow
from tests.helpers import chat_line, jsonl, long_line, wait_for, wait_until

openai = pytest.importorskip("openai")
from openai.lib import _webhooks as client_webhooks  # noqa: E402


class Receiver:
    """A local HTTP endpoint recording each POST (time, headers, body); the first `fail_first` answers are 500."""

    def __init__(self, fail_first: int = 0):
        self.received: list[tuple[float, dict, bytes]] = []
        self.fail_first = fail_first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((time.monotonic(), {k.lower(): v for k, v in self.headers.items()}, body))
                status = 500 if len(receiver.received) <= receiver.fail_first else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def events(self, client, secret: str) -> dict[str, list]:
        """Every received event verified and parsed by the client, by batch id."""
        out: dict[str, list] = {}
        for _, headers, body in self.received:
            event = client.webhooks.unwrap(body, headers, secret=secret)
            out.setdefault(event.data.id, []).append(event)
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()  # later deliveries to it are refused at once, not left waiting for an answer


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def oai(live_url, platform):
    return openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)


def test_endpoints_are_managed_with_the_official_client(oai, receiver):
    created = oai.webhooks.create(event_types=["batch.completed"], name="mine", url=receiver.url)
    assert isinstance(created, openai.types.webhooks.WebhookEndpointWithSecret)
    assert created.signing_secret.startswith("whsec_") and created.signing_secret_hint.endswith(
        created.signing_secret[-4:]
    )
    raw = oai.get(f"/webhook_endpoints/{created.id}", cast_to=object)
    assert "signing_secret" not in raw and set(raw) == set(openai.types.webhooks.WebhookEndpoint.model_fields)
    assert created.id in {e.id for e in oai.webhooks.list()}
    assert oai.webhooks.retrieve(created.id).url == receiver.url

    same = oai.webhooks.update(created.id, name="mine")
    assert same.updated_at == created.updated_at  # an unchanged update does not advance it
    renamed = oai.webhooks.update(created.id, name="renamed", event_types=["batch.completed", "batch.failed"])
    assert renamed.name == "renamed" and renamed.event_types == ["batch.completed", "batch.failed"]

    rotated = oai.webhooks.rotate_secret(created.id)
    assert rotated.signing_secret != created.signing_secret
    result = oai.webhooks.test(created.id, event_type="batch.completed")
    assert (result.status_code, result.success, result.webhook_endpoint_id) == (200, True, created.id)
    ((_, headers, body),) = receiver.received
    event = oai.webhooks.unwrap(body, headers, secret=rotated.signing_secret)
    assert event.type == "batch.completed" and event.data.id == "batch_test"
    with pytest.raises(openai.InvalidWebhookSignatureError):  # the old secret was dropped
        oai.webhooks.unwrap(body, headers, secret=created.signing_secret)

    kept = oai.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
    oai.webhooks.test(created.id, event_type="batch.failed")
    _, headers, body = receiver.received[-1]
    for secret in (kept.signing_secret, rotated.signing_secret):  # signed with both for a day
        assert oai.webhooks.unwrap(body, headers, secret=secret).type == "batch.failed"

    deleted = oai.webhooks.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "webhook_endpoint.deleted")
    with pytest.raises(openai.NotFoundError):
        oai.webhooks.retrieve(created.id)
    with pytest.raises(openai.BadRequestError):
        oai.webhooks.create(event_types=["batch.exploded"], name="x", url=receiver.url)


def test_loopback_and_private_urls_are_refused_unless_allowed(platform):
    strict = platform.app(webhook_allow_loopback=False).test_client()
    private = platform.app(webhook_allow_private=True).test_client()
    body = {"event_types": ["batch.completed"], "name": "n"}
    for url in ("http://127.0.0.1:9/x", "http://localhost/x", "http://[::1]/x", "http://10.1.2.3/x",
                "http://192.168.0.7/x", "http://169.254.169.254/latest/meta-data"):  # fmt: skip
        refused = strict.post("/v1/webhook_endpoints", json={**body, "url": url})
        assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "url_not_allowed", url
    assert private.post("/v1/webhook_endpoints", json={**body, "url": "http://10.1.2.3/x"}).status_code == 200
    metadata = private.post("/v1/webhook_endpoints", json={**body, "url": "http://169.254.169.254/x"})
    assert metadata.status_code == 403  # link-local (cloud metadata) is never called
    assert strict.post("/v1/webhook_endpoints", json={**body, "url": "http://93.184.216.34/x"}).status_code == 200
    assert strict.post("/v1/webhook_endpoints", json={**body, "url": "ftp://93.184.216.34/x"}).status_code == 400
    # a name that does not resolve now is saved (each delivery checks it again)
    unresolved = strict.post("/v1/webhook_endpoints", json={**body, "url": "http://no-such-host.invalid/x"})
    assert unresolved.status_code == 200
    # the session's platform is shared: endpoints to nowhere would get every later test's batch.completed
    for endpoint in strict.get("/v1/webhook_endpoints?limit=100").get_json()["data"]:
        if endpoint["url"] in ("http://10.1.2.3/x", "http://93.184.216.34/x", "http://no-such-host.invalid/x"):
            assert strict.delete(f"/v1/webhook_endpoints/{endpoint['id']}").status_code == 200


def _batch(oai, lines):
    file = oai.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    return oai.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")


def _status(oai, batch_id):
    return oai.batches.retrieve(batch_id).model_dump()


def test_batch_events_reach_a_local_receiver_signed_at_least_once(oai, worker, live_url, monkeypatch, capsys):
    receiver = Receiver(fail_first=1)  # the first delivery attempt fails: it is sent again after a backoff
    # the session's platform is shared: other tests (schemathesis) leave endpoints with made-up URLs in this tenant,
    # which would get these batches' events too and keep the worker's sender busy with names that do not resolve
    while stale := oai.get("/webhook_endpoints", cast_to=object, options={"params": {"limit": 100}})["data"]:
        for old in stale:
            oai.delete(f"/webhook_endpoints/{old['id']}", cast_to=object)
    try:
        endpoint = oai.webhooks.create(event_types=["batch.completed", "batch.cancelled", "batch.expired",
                                                    "batch.failed"], name="all", url=receiver.url)  # fmt: skip
        completed = _batch(oai, [chat_line(f"c-{i}", f"hi {i}") for i in range(3)])
        assert wait_for(lambda: _status(oai, completed.id))["status"] == "completed"

        cancelled = _batch(oai, [long_line(f"slow-{i}", max_tokens=200) for i in range(12)])
        oai.batches.cancel(cancelled.id)
        assert wait_for(lambda: _status(oai, cancelled.id))["status"] == "cancelled"

        expired = _batch(oai, [long_line(f"late-{i}", max_tokens=900) for i in range(12)])
        wait_for(lambda: _status(oai, expired.id), statuses=("in_progress",))
        with session_scope(worker.settings.database_url) as s:
            s.execute(update(Job).where(Job.id == expired.id).values(expires_at=utcnow() - timedelta(seconds=1)))
        assert expire_job(worker.settings, expired.id)  # what the sweeper does once the window passed
        assert wait_for(lambda: _status(oai, expired.id))["status"] == "expired"

        failed = _batch(oai, [chat_line("x", "hi"), chat_line("hot", "x", temperature=9)])
        assert wait_for(lambda: _status(oai, failed.id))["status"] == "failed"

        wanted = {completed.id: "batch.completed", cancelled.id: "batch.cancelled", expired.id: "batch.expired",
                  failed.id: "batch.failed"}  # fmt: skip
        deadline = time.monotonic() + 180  # a delivery that failed once backs off; a loaded machine is slow
        while set(wanted) - set(receiver.events(oai, endpoint.signing_secret)) and time.monotonic() < deadline:
            time.sleep(0.2)
        events = receiver.events(oai, endpoint.signing_secret)  # unwrap verifies each signature and timestamp
        log = oai.get(f"/webhook_endpoints/{endpoint.id}/deliveries", cast_to=object)["data"]
        for batch_id, event_type in wanted.items():
            assert batch_id in events, (batch_id, log, worker.worker_log()[-3000:])
            assert {e.type for e in events[batch_id]} == {event_type}, events.get(batch_id)
            assert all(e.object == "event" and e.id.startswith("evt_") for e in events[batch_id])

        # the failed first attempt was sent again, with the same webhook-id, after a backoff
        first = receiver.received[0]  # its event counts as received already: the retry may still be on its backoff
        second = wait_until(
            lambda: next((r for r in receiver.received[1:] if r[1]["webhook-id"] == first[1]["webhook-id"]), None),
            timeout=60,
            what="the failed delivery's retry",
        )
        assert second[0] - first[0] >= worker.settings.webhook_retry_base_s * 0.8

        def delivered_log():  # the sender records an attempt's answer just after the receiver has it
            log = oai.get(f"/webhook_endpoints/{endpoint.id}/deliveries", cast_to=object)["data"]
            return log if {d["status"] for d in log} == {"delivered"} and len(log) == len(wanted) else None

        log = wait_until(delivered_log, timeout=60, what="every delivery recorded as delivered")
        retried = next(d for d in log if d["event_id"] == first[1]["webhook-id"])
        assert (retried["status"], retried["attempts"], retried["last_status_code"]) == ("delivered", 2, 200)
        assert {d["status"] for d in log} == {"delivered"} and len(log) == len(wanted)
        monkeypatch.setenv("PAGEDBATCH_API_KEY", worker.api_key)
        capsys.readouterr()
        assert main(["webhooks", "--url", live_url]) == 0  # the CLI's glance at the delivery log
        glance = capsys.readouterr().out
        assert endpoint.id in glance and glance.count("delivered") == len(wanted) and "attempts=2" in glance

        # a tampered body and a replayed (old) delivery are refused by the client's check
        _, headers, body = receiver.received[-1]
        tampered = body.replace(b'"data":{"id":"batch_', b'"data":{"id":"batch_X')
        with pytest.raises(openai.InvalidWebhookSignatureError):
            oai.webhooks.unwrap(tampered, headers, secret=endpoint.signing_secret)
        later = time.time() + 600  # the same delivery, received ten minutes after it was signed
        monkeypatch.setattr(client_webhooks, "time", types.SimpleNamespace(time=lambda: later))
        with pytest.raises(openai.InvalidWebhookSignatureError, match="too old"):
            oai.webhooks.unwrap(body, headers, secret=endpoint.signing_secret)
    finally:
        receiver.close()
