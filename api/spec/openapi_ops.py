"""The building blocks of the OpenAPI document's operations (api.spec.openapi): references, JSON responses,
error responses, operations and links."""

from __future__ import annotations


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def json_response(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def error_doc(status: str, description: str) -> dict:
    response = json_response(ref("ErrorResponse"), description)
    if status == "429":
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}}
    return response


def operation(op_id: str, summary: str, ok: tuple[str, dict], errors: dict[str, str], **fields) -> dict:
    """One operation: its success response, its error responses (status: description) and any
    other OpenAPI operation fields (parameters, requestBody, security, description)."""
    responses = {ok[0]: ok[1], **{status: error_doc(status, text) for status, text in errors.items()}}
    return {"operationId": op_id, "summary": summary, **fields, "responses": responses}


def with_links(response: dict, targets: dict[str, str], **extra: dict) -> dict:
    """`response` with OpenAPI links: operationId -> the path parameter filled with the created object's id."""
    links = {op: {"operationId": op, "parameters": {param: "$response.body#/id"}} for op, param in targets.items()}
    return {**response, "links": {**links, **extra}}


PUBLIC = {"security": []}
AUTH = {"401": "Missing, unknown or revoked API key"}
ERRORS = {**AUTH, "400": "Invalid request", "404": "Not found (or another tenant's)"}
TOO_LARGE = {"413": "Too many bytes or lines"}
LIMITED = {"429": "Over the tenant's limit of active jobs or queued requests"}
