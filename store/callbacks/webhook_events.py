"""Webhook events as OpenAI sends them, signed per Standard Webhooks, and one HTTP POST of one.

An event body is `{"id": "evt_...", "object": "event", "created_at": ..., "type": "batch.completed",
"data": {"id": "batch_..."}}`. The headers `webhook-id` (the event id, the same on every attempt),
`webhook-timestamp` (Unix seconds of this attempt) and `webhook-signature` (`v1,<base64 HMAC-SHA256 of
"id.timestamp.body">` with the secret's base64-decoded bytes, one per active secret, space-separated) are
what `openai.OpenAI().webhooks.unwrap(body, headers, secret=...)` verifies.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from store import ids
from store.models import CANCELLED, COMPLETED, EXPIRED, FAILED

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_OF_STATUS = {COMPLETED: "batch.completed", FAILED: "batch.failed", CANCELLED: "batch.cancelled",
                   EXPIRED: "batch.expired"}  # fmt: skip
SECRET_PREFIX = "whsec_"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    return SECRET_PREFIX + "..." + secret[-4:]


def event_id() -> str:
    return ids.new_id("evt_")


def event_body(event: str, event_type: str, batch_id: str, created_at: int) -> str:
    """The exact text that is signed and sent."""
    body = {"id": event, "object": "event", "created_at": created_at, "type": event_type, "data": {"id": batch_id}}
    return json.dumps(body, separators=(",", ":"))


def signature(secret: str, event: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    mac = hmac.new(key, f"{event}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(secrets_: list[str], event: str, body: str, timestamp: int | None = None) -> dict[str, str]:
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        "content-type": "application/json",
        "user-agent": "pagedbatch-webhooks",
        "webhook-id": event,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, event, timestamp, body) for s in secrets_),
    }


@dataclass
class Answer:
    status_code: int  # 0: no HTTP answer
    error: str | None

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect is an answer, not followed: it could lead to an address that is not allowed


_opener = urllib.request.build_opener(_NoRedirects)


def post(url: str, body: str, headers: dict[str, str], timeout: float) -> Answer:
    """POST the event; only the status is read (the endpoint's body is drained up to 64 KiB)."""
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with _opener.open(request, timeout=timeout) as response:
            response.read(1 << 16)
            return Answer(response.status, None)
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, f"HTTP {exc.code}")
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, unreachable, bad URL
        return Answer(0, f"{type(exc).__name__}: {exc}"[:500])
