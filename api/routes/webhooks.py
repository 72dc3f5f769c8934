"""Webhook endpoints as OpenAI's API shapes them (/v1/webhook_endpoints: create, list, retrieve, update,
delete, rotate_secret, test), and pagedbatch's delivery log of each endpoint."""

from __future__ import annotations

from flask import Blueprint

from api.auth import current_tenant
from api.inputs import BatchListQuery
from api.objects_webhooks import (
    DeletedWebhookEndpoint,
    WebhookCreate,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookEndpoint,
    WebhookEndpointList,
    WebhookEndpointTestResult,
    WebhookEndpointWithSecret,
    WebhookRotate,
    WebhookTest,
    WebhookUpdate,
)
from api.platform import settings
from api.routes.params import json_body, query, reject_nul_bytes
from api.routes.responses import send_object
from api.serializers import page, ts
from store.callbacks import webhooks
from store.callbacks.webhook_events import event_body, event_id, post, secret_hint, signed_headers
from store.callbacks.webhook_urls import check_url

bp = Blueprint("webhooks", __name__)
bp.before_request(reject_nul_bytes)


def _endpoint(record, *, with_secret: bool = False):
    fields = dict(
        id=record.id, created_at=ts(record.created_at), event_types=list(record.event_types), name=record.name,
        url=record.url, signing_secret_hint=secret_hint(record.secret), updated_at=ts(record.updated_at),
    )  # fmt: skip
    return (
        WebhookEndpointWithSecret(**fields, signing_secret=record.secret) if with_secret else WebhookEndpoint(**fields)
    )


def _delivery(record) -> WebhookDelivery:
    return WebhookDelivery(
        id=record.id, webhook_endpoint_id=record.endpoint_id, event_id=record.event_id, event_type=record.event_type,
        status=record.status, attempts=record.attempts, last_status_code=record.last_status_code,
        last_error=record.last_error, created_at=ts(record.created_at), next_attempt_at=ts(record.next_attempt_at),
        delivered_at=ts(record.delivered_at),
    )  # fmt: skip


@bp.post("/v1/webhook_endpoints")
def create_endpoint():
    body = json_body(WebhookCreate)
    record = webhooks.create_endpoint(
        settings(), current_tenant(), name=body.name, url=body.url, event_types=list(body.event_types)
    )
    return send_object(_endpoint(record, with_secret=True))


@bp.get("/v1/webhook_endpoints")
def list_endpoints():
    params = query(BatchListQuery)
    records, has_more = webhooks.list_endpoints(settings(), current_tenant(), limit=params.limit, after=params.after)
    return send_object(page(WebhookEndpointList, [_endpoint(r) for r in records], has_more))


@bp.get("/v1/webhook_endpoints/<webhook_endpoint_id>")
def get_endpoint(webhook_endpoint_id: str):
    return send_object(_endpoint(webhooks.get_endpoint(settings(), current_tenant(), webhook_endpoint_id)))


@bp.post("/v1/webhook_endpoints/<webhook_endpoint_id>")
def update_endpoint(webhook_endpoint_id: str):
    body = json_body(WebhookUpdate)
    record = webhooks.update_endpoint(
        settings(), current_tenant(), webhook_endpoint_id, name=body.name, url=body.url,
        event_types=list(body.event_types) if body.event_types is not None else None,
    )  # fmt: skip
    return send_object(_endpoint(record))


@bp.delete("/v1/webhook_endpoints/<webhook_endpoint_id>")
def delete_endpoint(webhook_endpoint_id: str):
    record = webhooks.delete_endpoint(settings(), current_tenant(), webhook_endpoint_id)
    return send_object(DeletedWebhookEndpoint(id=record.id, deleted=True))


@bp.post("/v1/webhook_endpoints/<webhook_endpoint_id>/rotate_secret")
def rotate_secret(webhook_endpoint_id: str):
    body = json_body(WebhookRotate)
    record = webhooks.rotate_secret(
        settings(), current_tenant(), webhook_endpoint_id, keep_old=body.keep_old_secret_active_for_24_hours
    )
    return send_object(_endpoint(record, with_secret=True))


@bp.post("/v1/webhook_endpoints/<webhook_endpoint_id>/test")
def test_endpoint(webhook_endpoint_id: str):
    """A sample event of `event_type` (data.id "batch_test"), signed and sent now; its answer is returned."""
    body = json_body(WebhookTest)
    cfg = settings()
    record = webhooks.get_endpoint(cfg, current_tenant(), webhook_endpoint_id)
    check_url(cfg, record.url, unresolved_ok=True)  # where it resolves now (a name that does not: status_code 0)
    event = event_id()
    text = event_body(event, body.event_type, "batch_test", ts(record.created_at) or 0)
    answer = post(
        record.url, text, signed_headers(webhooks.signing_secrets(record), event, text), cfg.webhook_timeout_s
    )
    return send_object(WebhookEndpointTestResult(
        event_type=body.event_type, status_code=answer.status_code, webhook_endpoint_id=record.id
    ))  # fmt: skip


@bp.get("/v1/webhook_endpoints/<webhook_endpoint_id>/deliveries")
def list_deliveries(webhook_endpoint_id: str):
    """pagedbatch's delivery log: each event sent to the endpoint, newest first, with its attempts."""
    params = query(BatchListQuery)
    records, has_more = webhooks.list_deliveries(
        settings(), current_tenant(), webhook_endpoint_id, limit=params.limit, after=params.after
    )
    return send_object(page(WebhookDeliveryList, [_delivery(r) for r in records], has_more))
