"""Who is signed in to the dashboard: the session cookie holds the tenant and the sha256 of its API key
(never the key), checked against the keys table on every request so that a revoked key signs out.
Admins are the tenants named in PAGEDBATCH_ADMIN_TENANTS (default "admin")."""

from __future__ import annotations

import hmac
import secrets

from flask import abort, g, request, session
from sqlalchemy import select

from api.platform import settings
from settings import ApiSettings, current
from store.db import session_scope
from store.keys import hash_key
from store.models import ApiKey

CSRF_FIELD, CSRF_HEADER = "csrf_token", "X-CSRF-Token"


def admin_tenants() -> set[str]:
    return {t.strip() for t in current(ApiSettings).admin_tenants.split(",") if t.strip()}


def tenant_of_hash(key_hash: str) -> str | None:
    with session_scope(settings().database_url) as s:
        return s.scalar(select(ApiKey.tenant).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None)))


def sign_in(key: str) -> str | None:
    """The key's tenant, now signed in (a fresh session: no fixation), or None for a bad key."""
    key_hash = hash_key(key.strip())
    tenant = tenant_of_hash(key_hash)
    if tenant is None:
        return None
    session.clear()
    session.permanent = True
    session.update(tenant=tenant, key_hash=key_hash, csrf=secrets.token_urlsafe(24))
    return tenant


def sign_out() -> None:
    session.clear()


def load_user() -> str | None:
    """Set `g.tenant` and `g.is_admin` from the session; None when nobody (or a revoked key) is signed in."""
    key_hash = session.get("key_hash")
    tenant = tenant_of_hash(key_hash) if key_hash else None
    if tenant is None or tenant != session.get("tenant"):
        session.pop("key_hash", None)
        session.pop("tenant", None)
        return None
    g.tenant = tenant
    g.is_admin = tenant in admin_tenants()
    return tenant


def csrf_token() -> str:
    """This session's token (one is made for a visitor not signed in yet, for the sign-in form)."""
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(24)
    return session["csrf"]


def check_csrf() -> None:
    """A 400 unless the POST carries this session's token (form field or header)."""
    sent = request.form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
    expected = session.get("csrf") or ""
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        abort(400, description="missing or wrong CSRF token; reload the page and try again")
