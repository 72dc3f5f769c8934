"""An `x-request-id` header on every response (OpenAI's `req_...`), also on errors and refused requests.

A caller's own `X-Request-Id` (a proxy's) is kept when it is short and printable."""

from __future__ import annotations

import re
import uuid

from flask import Flask, Response, g, request

HEADER = "x-request-id"
_ACCEPTED = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _assign() -> None:
    given = request.headers.get(HEADER, "")
    g.request_id = given if _ACCEPTED.fullmatch(given) else f"req_{uuid.uuid4().hex}"


def _send(response: Response) -> Response:
    response.headers[HEADER] = g.get("request_id") or f"req_{uuid.uuid4().hex}"
    return response


def install(app: Flask) -> None:
    """The first before_request hook, so a request refused by authentication has one too."""
    app.before_request_funcs.setdefault(None, []).insert(0, _assign)
    app.after_request(_send)
