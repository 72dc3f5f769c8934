"""Webhook endpoints (a tenant's URLs, their event types and signing secrets) and the delivery log.

A job's end becomes one delivery per endpoint of its tenant that asked for that event (`announce_ended_jobs`,
run by the workers' webhook sender); `due_deliveries` claims what is due and `record_attempt` writes each
attempt's outcome: delivered on a 2xx, else tried again with doubling waits until `webhook_max_attempts`.
"""

from __future__ import annotations

import random
from datetime import timedelta

from sqlalchemy import select

from store import ids
from store.callbacks.webhook_events import EVENT_OF_STATUS, event_body, event_id, new_secret
from store.callbacks.webhook_urls import check_url
from store.db import session_scope
from store.errors import NotFound
from store.models import (
    DELIVERY_DELIVERED,
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    TERMINAL_STATUSES,
    Job,
    WebhookDelivery,
    WebhookEndpoint,
    utcnow,
)
from store.pagination import page
from store.settings import Settings

KEEP_OLD_SECRET = timedelta(hours=24)


def create_endpoint(settings: Settings, tenant: str, *, name: str, url: str, event_types: list[str]) -> WebhookEndpoint:
    check_url(settings, url, unresolved_ok=True)
    now = utcnow()
    endpoint = WebhookEndpoint(
        id=ids.new_id("we_"), tenant=tenant, name=name, url=url, event_types=sorted(set(event_types)),
        secret=new_secret(), created_at=now, updated_at=now,
    )  # fmt: skip
    with session_scope(settings.database_url) as s:
        s.add(endpoint)
    return endpoint


def get_endpoint(settings: Settings, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    with session_scope(settings.database_url) as s:
        endpoint = s.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or endpoint.tenant != tenant or endpoint.deleted_at is not None:
        raise NotFound(f"No such webhook endpoint: {endpoint_id}", param="webhook_endpoint_id")
    return endpoint


def list_endpoints(settings: Settings, tenant: str, *, limit: int = 20, after: str | None = None):
    with session_scope(settings.database_url) as s:
        query = select(WebhookEndpoint).where(WebhookEndpoint.tenant == tenant, WebhookEndpoint.deleted_at.is_(None))
        return page(s, WebhookEndpoint, query, tenant, limit, after, "webhook endpoint")


def update_endpoint(settings: Settings, tenant: str, endpoint_id: str, **changes) -> WebhookEndpoint:
    """`changes` (name, url, event_types; None: unchanged) applied; `updated_at` moves only if one differs."""
    get_endpoint(settings, tenant, endpoint_id)
    if changes.get("url") is not None:
        check_url(settings, changes["url"], unresolved_ok=True)
    if changes.get("event_types") is not None:
        changes["event_types"] = sorted(set(changes["event_types"]))
    with session_scope(settings.database_url) as s:
        endpoint = s.get(WebhookEndpoint, endpoint_id, with_for_update=True)
        changed = {k: v for k, v in changes.items() if v is not None and getattr(endpoint, k) != v}
        for key, value in changed.items():
            setattr(endpoint, key, value)
        if changed:
            endpoint.updated_at = utcnow()
    return endpoint


def delete_endpoint(settings: Settings, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    """No more deliveries to it (pending ones are dropped); its row and log stay."""
    get_endpoint(settings, tenant, endpoint_id)
    with session_scope(settings.database_url) as s:
        endpoint = s.get(WebhookEndpoint, endpoint_id, with_for_update=True)
        endpoint.deleted_at = utcnow()
        for delivery in s.scalars(select(WebhookDelivery).where(
            WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.status == DELIVERY_PENDING
        )):  # fmt: skip
            delivery.status, delivery.last_error, delivery.next_attempt_at = DELIVERY_FAILED, "endpoint deleted", None
    return endpoint


def rotate_secret(settings: Settings, tenant: str, endpoint_id: str, *, keep_old: bool = False) -> WebhookEndpoint:
    """A new secret; with `keep_old`, deliveries are signed with the old one too for 24 hours."""
    get_endpoint(settings, tenant, endpoint_id)
    with session_scope(settings.database_url) as s:
        endpoint = s.get(WebhookEndpoint, endpoint_id, with_for_update=True)
        now = utcnow()
        endpoint.previous_secret = endpoint.secret if keep_old else None
        endpoint.previous_secret_until = now + KEEP_OLD_SECRET if keep_old else None
        endpoint.secret, endpoint.updated_at = new_secret(), now
    return endpoint


def signing_secrets(endpoint: WebhookEndpoint) -> list[str]:
    kept = endpoint.previous_secret and endpoint.previous_secret_until and endpoint.previous_secret_until > utcnow()
    return [endpoint.secret, endpoint.previous_secret] if kept else [endpoint.secret]


def announce_ended_jobs(settings: Settings, limit: int = 200) -> int:
    """Ended jobs not announced yet become deliveries to their tenants' endpoints that want the event;
    returns how many jobs were announced. Safe from many processes (rows claimed with SKIP LOCKED)."""
    with session_scope(settings.database_url) as s:
        ended = list(s.scalars(
            select(Job).where(Job.status.in_(TERMINAL_STATUSES), Job.announced_at.is_(None))
            .limit(limit).with_for_update(skip_locked=True)
        ))  # fmt: skip
        tenants = {job.tenant for job in ended}
        endpoints = list(s.scalars(select(WebhookEndpoint).where(
            WebhookEndpoint.tenant.in_(tenants), WebhookEndpoint.deleted_at.is_(None)
        ))) if tenants else []  # fmt: skip
        now = utcnow()
        for job in ended:
            job.announced_at = now
            event_type = EVENT_OF_STATUS[job.status]
            wanting = [e for e in endpoints if e.tenant == job.tenant and event_type in e.event_types]
            if not wanting:
                continue
            event = event_id()
            body = event_body(event, event_type, job.id, int(now.timestamp()))
            for endpoint in wanting:
                s.add(WebhookDelivery(
                    id=ids.new_id("whd_"), endpoint_id=endpoint.id, tenant=job.tenant, event_id=event,
                    event_type=event_type, body=body, status=DELIVERY_PENDING, attempts=0, next_attempt_at=now,
                    created_at=now,
                ))  # fmt: skip
    return len(ended)


def due_deliveries(
    settings: Settings, lease_s: float, limit: int = 20
) -> list[tuple[WebhookDelivery, WebhookEndpoint]]:
    """Pending deliveries whose time has come, with their endpoints; each is leased for `lease_s` (its next
    attempt pushed back) so that another sender does not send it at the same time."""
    with session_scope(settings.database_url) as s:
        due = list(s.scalars(
            select(WebhookDelivery).where(
                WebhookDelivery.status == DELIVERY_PENDING, WebhookDelivery.next_attempt_at <= utcnow()
            ).order_by(WebhookDelivery.next_attempt_at).limit(limit).with_for_update(skip_locked=True)
        ))  # fmt: skip
        lease = utcnow() + timedelta(seconds=lease_s)
        out = []
        for delivery in due:
            delivery.next_attempt_at = lease
            out.append((delivery, s.get(WebhookEndpoint, delivery.endpoint_id)))
    return out


def record_attempt(settings: Settings, delivery_id: str, status_code: int, error: str | None) -> WebhookDelivery:
    """One attempt's outcome: delivered on a 2xx; else the next attempt after a doubling, jittered wait, or
    failed once `webhook_max_attempts` are spent."""
    with session_scope(settings.database_url) as s:
        delivery = s.get(WebhookDelivery, delivery_id, with_for_update=True)
        delivery.attempts += 1
        delivery.last_status_code, delivery.last_error = status_code or None, error
        now = utcnow()
        if 200 <= status_code < 300:
            delivery.status, delivery.delivered_at, delivery.next_attempt_at = DELIVERY_DELIVERED, now, None
        elif delivery.attempts >= settings.webhook_max_attempts:
            delivery.status, delivery.next_attempt_at = DELIVERY_FAILED, None
        else:
            wait = settings.webhook_retry_base_s * 2 ** (delivery.attempts - 1) * random.uniform(0.8, 1.2)
            delivery.next_attempt_at = now + timedelta(seconds=wait)
    return delivery


def list_deliveries(settings: Settings, tenant: str, endpoint_id: str, *, limit: int = 20, after: str | None = None):
    get_endpoint(settings, tenant, endpoint_id)
    with session_scope(settings.database_url) as s:
        query = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
        return page(s, WebhookDelivery, query, tenant, limit, after, "webhook delivery")
