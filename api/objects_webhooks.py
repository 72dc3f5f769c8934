"""API objects of webhooks (OpenAI's WebhookEndpoint and its create, update, rotate and test shapes, field
for field) and pagedbatch's delivery log."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StringConstraints

from api.objects import ApiObject, ListOf
from store.callbacks.webhook_events import EVENT_TYPES

EventType = Literal[EVENT_TYPES]
Name = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00]*$")]
Url = Annotated[str, StringConstraints(min_length=1, max_length=2048, pattern=r"^https?://[^\x00-\x20\x7f]+$")]


class WebhookEndpoint(ApiObject):
    """OpenAI's WebhookEndpoint."""

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int = Field(description="Unix seconds")
    event_types: list[str]
    name: str
    url: str
    signing_secret_hint: str | None
    """The secret's last characters"""
    updated_at: int | None = Field(description="Unix seconds")


class WebhookEndpointWithSecret(WebhookEndpoint):
    """The endpoint as created or rotated: the only time its signing secret is sent."""

    signing_secret: str
    """whsec_ and base64: verify deliveries with it (Standard Webhooks, `client.webhooks.unwrap`)"""


class DeletedWebhookEndpoint(ApiObject):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool


class WebhookEndpointTestResult(ApiObject):
    event_type: str
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    status_code: int
    """The endpoint's answer (0: no answer)"""
    success: Literal[True] = True
    webhook_endpoint_id: str


class WebhookEndpointList(ListOf[WebhookEndpoint]):
    pass


class WebhookDelivery(ApiObject):
    """One event sent (or being sent) to one endpoint: pagedbatch's delivery log."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_endpoint_id: str
    event_id: str
    """The webhook-id header, the same on every attempt"""
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None
    created_at: int = Field(description="Unix seconds")
    next_attempt_at: int | None = Field(description="Unix seconds")
    delivered_at: int | None = Field(description="Unix seconds")


class WebhookDeliveryList(ListOf[WebhookDelivery]):
    pass


class WebhookCreate(ApiObject):
    """The body of POST /v1/webhook_endpoints."""

    model_config = ConfigDict(extra="allow")

    event_types: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES))
    name: Name
    url: Url


class WebhookUpdate(ApiObject):
    """The body of POST /v1/webhook_endpoints/{id}: the fields given replace the endpoint's."""

    model_config = ConfigDict(extra="allow")

    event_types: list[EventType] | None = Field(None, min_length=1, max_length=len(EVENT_TYPES))
    name: Name | None = None
    url: Url | None = None


class WebhookRotate(ApiObject):
    model_config = ConfigDict(extra="allow")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookTest(ApiObject):
    model_config = ConfigDict(extra="allow")

    event_type: EventType


WEBHOOK_RESPONSES = (WebhookEndpoint, WebhookEndpointWithSecret, DeletedWebhookEndpoint, WebhookEndpointTestResult,
                     WebhookEndpointList, WebhookDeliveryList)  # fmt: skip
WEBHOOK_REQUESTS = (WebhookCreate, WebhookUpdate, WebhookRotate, WebhookTest)
