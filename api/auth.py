"""Who is calling: every request but the public ones carries `Authorization: Bearer <API key>`.

`authenticate` is the app's one before_request hook (registered by api.app); routes ask
`current_tenant()` and scope every read and write by it.
"""

from __future__ import annotations

from flask import g, request

from api.errors import ApiError
from api.platform import settings
from store import keys

PUBLIC_ENDPOINTS = frozenset({"meta.healthz", "meta.readyz", "meta.openapi", "metrics.metrics"})
UI_BLUEPRINTS = frozenset({"ui", "ui_actions"})  # the dashboard signs in with a session cookie (api.ui.session)
UI_ROOT = "/ui"  # without its slash: routing redirects it to the dashboard's "/ui/", as a browser expects


class Unauthorized(ApiError):
    def __init__(self, message: str, code: str):
        super().__init__(401, message, code=code)
        self.headers = {"WWW-Authenticate": 'Bearer realm="pagedbatch"'}


def bearer_key() -> str | None:
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def authenticate() -> None:
    """Set `g.tenant` from the request's API key, or answer 401 (unknown routes included)."""
    if request.endpoint in PUBLIC_ENDPOINTS or request.blueprint in UI_BLUEPRINTS or request.path == UI_ROOT:
        return
    key = bearer_key()
    if key is None:
        raise Unauthorized(
            "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
            "(Authorization: Bearer YOUR_KEY).",
            "missing_api_key",
        )
    tenant = keys.tenant_for_key(settings(), key)
    if tenant is None:  # unknown and revoked keys answer alike
        raise Unauthorized("Incorrect API key provided.", "invalid_api_key")
    g.tenant = tenant


def current_tenant() -> str:
    """The authenticated tenant of this request."""
    return g.tenant
