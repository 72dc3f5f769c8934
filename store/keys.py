"""API keys: create, list, revoke, and look up the tenant of a presented key.

A key is `pb-` and 40 url-safe random characters (240 bits). Only its sha256 is stored, with a short
prefix so that a person can tell keys apart in a list; the key itself is shown once, when created.
A high-entropy key needs no salt or slow hash: the lookup is by hash, so no comparison timing leaks.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import select

from store import ids
from store.db import session_scope
from store.models import ApiKey, Tenant, utcnow
from store.settings import Settings

KEY_PREFIX = "pb-"
SHOWN_PREFIX = 10  # "pb-" and 7 characters: enough to recognise, far too few to guess from
LOCAL_KEY_FILE = "api_key"  # where `serve` keeps its local key, in its data dir


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: never the key itself."""

    id: str
    tenant: str
    prefix: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)  # 30 bytes -> 40 characters


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.tenant, row.prefix, row.name, row.created_at, row.revoked_at)


def ensure_tenant(session, name: str) -> Tenant:
    tenant = session.get(Tenant, name)
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(settings: Settings, tenant: str | None = None, *, name: str | None = None) -> tuple[str, KeyInfo]:
    """A new key for `tenant` (created if new): (the key, to show once; its listing)."""
    tenant = tenant or settings.default_tenant
    if not tenant or len(tenant) > 64:
        raise ValueError("a tenant name is 1 to 64 characters")
    key = new_key()
    row = ApiKey(id=ids.new_id("key_", 16), tenant=tenant, key_hash=hash_key(key), prefix=key[:SHOWN_PREFIX], name=name)
    with session_scope(settings.database_url) as s:
        ensure_tenant(s, tenant)
        s.add(row)
        s.flush()
        return key, _info(row)


def list_keys(settings: Settings, tenant: str | None = None) -> list[KeyInfo]:
    with session_scope(settings.database_url) as s:
        query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
        if tenant:
            query = query.where(ApiKey.tenant == tenant)
        return [_info(row) for row in s.scalars(query)]


def revoke_key(settings: Settings, key_id: str) -> KeyInfo:
    """Revoke a key by id (idempotent); KeyError when there is no such key."""
    with session_scope(settings.database_url) as s:
        row = s.get(ApiKey, key_id, with_for_update=True)
        if row is None:
            raise KeyError(key_id)
        if row.revoked_at is None:
            row.revoked_at = utcnow()
        info = _info(row)
    _cache.forget(settings.database_url, row.key_hash)
    return info


class _TenantCache:
    """Recently checked key hashes -> tenant, so that polling clients do not cost a query each.

    A revocation in this process takes effect at once; one in another process within `key_cache_s`.
    """

    def __init__(self, size: int = 10_000):
        self.size = size
        self._items: dict[tuple[str, str], tuple[str, float]] = {}
        self._lock = threading.Lock()

    def get(self, url: str, digest: str, ttl: float) -> str | None:
        with self._lock:
            item = self._items.get((url, digest))
        if item is not None and time.monotonic() - item[1] < ttl:
            return item[0]
        return None

    def put(self, url: str, digest: str, tenant: str) -> None:
        with self._lock:
            if len(self._items) >= self.size:
                self._items.clear()
            self._items[(url, digest)] = (tenant, time.monotonic())

    def forget(self, url: str, digest: str) -> None:
        with self._lock:
            self._items.pop((url, digest), None)


_cache = _TenantCache()


def tenant_for_key(settings: Settings, key: str) -> str | None:
    """The tenant of an active key; None for an unknown or revoked key."""
    if not key.startswith(KEY_PREFIX) or len(key) > 256:
        return None
    digest = hash_key(key)
    ttl = settings.key_cache_s
    if ttl > 0 and (tenant := _cache.get(settings.database_url, digest, ttl)) is not None:
        return tenant
    with session_scope(settings.database_url) as s:
        tenant = s.scalar(select(ApiKey.tenant).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None)))
    if tenant is not None and ttl > 0:
        _cache.put(settings.database_url, digest, tenant)
    return tenant


# ---- tenants' limits ---------------------------------------------------------------------


def set_tenant_limits(
    settings: Settings,
    tenant: str,
    *,
    max_active_jobs: int | None,
    max_queued_requests: int | None,
    max_files: int | None = None,
    max_file_bytes: int | None = None,
    weight: float | None = None,
) -> Tenant:
    """Per-tenant limits overriding the settings' (None: use the settings'; 0: unlimited), and the tenant's
    fair-share weight in the workers (a positive number; None: unchanged, 1 for a new tenant)."""
    if weight is not None and not (isinstance(weight, int | float) and 0 < weight < math.inf):
        raise ValueError(f"a tenant's weight is a positive number, got {weight!r:.40}")
    with session_scope(settings.database_url) as s:
        row = ensure_tenant(s, tenant)
        row.max_active_jobs = max_active_jobs
        row.max_queued_requests = max_queued_requests
        row.max_files = max_files
        row.max_file_bytes = max_file_bytes
        if weight is not None:
            row.weight = float(weight)
        return row


def list_tenants(settings: Settings) -> list[Tenant]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Tenant).order_by(Tenant.name)))


# ---- serve's local key -----------------------------------------------------------------------


def local_key_path(data_dir: str | Path) -> Path:
    return Path(data_dir).expanduser() / LOCAL_KEY_FILE


def read_local_key(data_dir: str | Path) -> str | None:
    try:
        key = local_key_path(data_dir).read_text().strip()
    except OSError:
        return None
    return key or None


def ensure_local_key(settings: Settings, data_dir: str | Path) -> tuple[str, bool]:
    """`serve`'s key for the default tenant, kept in `data_dir` (mode 0600): (key, whether it is new).

    The saved key is reused while it is valid in this database; otherwise a new one replaces it.
    """
    saved = read_local_key(data_dir)
    if saved and tenant_for_key(settings, saved) is not None:
        return saved, False
    key, _ = create_key(settings, settings.default_tenant, name="serve (local)")
    path = local_key_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.replace(path)
    return key, True
