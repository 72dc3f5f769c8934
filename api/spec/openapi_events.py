"""The OpenAPI document's paths of uploads in parts (OpenAI's Uploads API) and webhook endpoints."""

from __future__ import annotations

from api.inputs import BatchListQuery
from api.spec.openapi_ops import ERRORS, TOO_LARGE, json_response, operation, ref, with_links
from api.spec.openapi_schemas import path_id, query_parameters

UPLOAD_ID = path_id("upload_id", "An upload id (upload_...)")
ENDPOINT_ID = path_id("webhook_endpoint_id", "A webhook endpoint id (we_...)")
CONFLICT = {"409": "The upload is no longer pending"}
BODY_LIMIT = {"413": "Body over 64 KiB"}
URL_REFUSED = {"403": "The url is not one this deployment calls (a loopback, private or reserved address)"}


def _body(name: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": ref(name)}}}


def upload_paths() -> dict:
    upload = ("200", json_response(ref("Upload")))
    part_body = {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "format": "binary", "description": "The part's bytes"}},
    }}}}  # fmt: skip
    links = {"addUploadPart": "upload_id", "completeUpload": "upload_id", "cancelUpload": "upload_id"}
    return {
        "/v1/uploads": {
            "post": operation(
                "createUpload",
                "Start an upload in parts (OpenAI)",
                ("200", with_links(upload[1], links)),
                {**ERRORS, **TOO_LARGE},
                requestBody=_body("UploadCreate"),
                description="`bytes` is the whole file's size (at most the deployment's upload limit). A pending "
                "upload expires an hour after it is created (PAGEDBATCH_UPLOAD_EXPIRES_S) and its parts are deleted.",
            ),
            "get": operation(
                "listUploads",
                "List the tenant's uploads, newest first (pagedbatch: find a pending one to resume)",
                ("200", json_response(ref("UploadList"))),
                ERRORS,
                parameters=query_parameters(BatchListQuery),
            ),
        },
        "/v1/uploads/{upload_id}/parts": {
            "post": operation(
                "addUploadPart",
                "Add a part (OpenAI)",
                (
                    "200",
                    {
                        **json_response(ref("UploadPart")),
                        "links": {
                            "completeUpload": {
                                "operationId": "completeUpload",
                                "parameters": {"upload_id": "$response.body#/upload_id"},
                                "requestBody": {"part_ids": ["$response.body#/id"]},
                            }
                        },
                    },
                ),
                {**ERRORS, **TOO_LARGE, **CONFLICT},
                parameters=[UPLOAD_ID],
                requestBody=part_body,
                description="At most 64 MiB a part (PAGEDBATCH_MAX_UPLOAD_PART_BYTES) and 10,000 parts; the "
                "parts together at most the upload's `bytes`. A part whose request broke off is not recorded: "
                "send it again.",
            )
        },
        "/v1/uploads/{upload_id}/complete": {
            "post": operation(
                "completeUpload",
                "Join the parts into a batch input file (OpenAI)",
                upload,
                {**ERRORS, **TOO_LARGE, **CONFLICT},
                parameters=[UPLOAD_ID],
                requestBody=_body("UploadComplete"),
                description="The parts in `part_ids`' order must hold exactly `bytes`; with `md5` the joined file "
                "is checked. The file is held to the limits of a /v1/files upload; `file` is the result.",
            )
        },
        "/v1/uploads/{upload_id}/cancel": {
            "post": operation(
                "cancelUpload", "Cancel an upload (OpenAI)", upload, {**ERRORS, **CONFLICT}, parameters=[UPLOAD_ID]
            )
        },
    }


def webhook_paths() -> dict:
    endpoint = ("200", json_response(ref("WebhookEndpoint")))
    with_secret = ("200", json_response(ref("WebhookEndpointWithSecret")))
    operations = (
        "getWebhookEndpoint",
        "updateWebhookEndpoint",
        "deleteWebhookEndpoint",
        "listWebhookDeliveries",
        "rotateWebhookSecret",
        "testWebhookEndpoint",
    )
    links = dict.fromkeys(operations, "webhook_endpoint_id")
    one = {"parameters": [ENDPOINT_ID]}
    return {
        "/v1/webhook_endpoints": {
            "post": operation(
                "createWebhookEndpoint",
                "Create a webhook endpoint (OpenAI)",
                ("200", with_links(with_secret[1], links)),
                {**ERRORS, **URL_REFUSED, **BODY_LIMIT},
                requestBody=_body("WebhookCreate"),
                description="The only answer that holds `signing_secret` (besides rotate_secret). A URL on a loopback "
                "or private address is refused unless the deployment allows it.",
            ),
            "get": operation(
                "listWebhookEndpoints",
                "List webhook endpoints (OpenAI)",
                ("200", json_response(ref("WebhookEndpointList"))),
                ERRORS,
                parameters=query_parameters(BatchListQuery),
            ),
        },
        "/v1/webhook_endpoints/{webhook_endpoint_id}": {
            "get": operation("getWebhookEndpoint", "A webhook endpoint (OpenAI)", endpoint, ERRORS, **one),
            "post": operation(
                "updateWebhookEndpoint",
                "Update a webhook endpoint (OpenAI)",
                endpoint,
                {**ERRORS, **URL_REFUSED, **BODY_LIMIT},
                requestBody={**_body("WebhookUpdate"), "required": False},
                **one,
            ),
            "delete": operation(
                "deleteWebhookEndpoint",
                "Delete a webhook endpoint (OpenAI)",
                ("200", json_response(ref("DeletedWebhookEndpoint"))),
                ERRORS,
                **one,
            ),
        },
        "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret": {
            "post": operation(
                "rotateWebhookSecret",
                "A new signing secret (OpenAI)",
                with_secret,
                {**ERRORS, **BODY_LIMIT},
                requestBody={**_body("WebhookRotate"), "required": False},
                **one,
            )
        },
        "/v1/webhook_endpoints/{webhook_endpoint_id}/test": {
            "post": operation(
                "testWebhookEndpoint",
                "Send a signed sample event now (OpenAI); `status_code` is the endpoint's answer (0: none)",
                ("200", json_response(ref("WebhookEndpointTestResult"))),
                {**ERRORS, **URL_REFUSED, **BODY_LIMIT},
                requestBody=_body("WebhookTest"),
                **one,
            )
        },
        "/v1/webhook_endpoints/{webhook_endpoint_id}/deliveries": {
            "get": operation(
                "listWebhookDeliveries",
                "The endpoint's delivery log, newest first (pagedbatch)",
                ("200", json_response(ref("WebhookDeliveryList"))),
                ERRORS,
                parameters=[ENDPOINT_ID, *query_parameters(BatchListQuery)],
            )
        },
    }
