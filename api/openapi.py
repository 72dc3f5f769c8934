"""The OpenAPI 3.1 document served at /openapi.json.

`components.schemas` is generated from the pydantic models in api.objects, the same ones the
serializers fill, so a documented shape cannot drift from the JSON sent. A test checks the paths
against the app's routes.
"""

from __future__ import annotations

import functools

from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from api.objects import METADATA_PAIRS, REQUEST_OBJECTS, RESPONSE_OBJECTS
from store.models import INVALID_LINE_POLICIES, JOB_STATUSES, MAX_PRIORITY, MIN_PRIORITY


class _ComponentSchema(GenerateJsonSchema):
    """pydantic's JSON schema without a title on every property (the property name says it)."""

    def field_title_should_be_set(self, schema) -> bool:
        return False


def component_schemas() -> dict:
    """Every API object's JSON schema by name, with refs under #/components/schemas/."""
    models = [(m, "serialization") for m in RESPONSE_OBJECTS] + [(m, "validation") for m in REQUEST_OBJECTS]
    _, schemas = models_json_schema(
        models, ref_template="#/components/schemas/{model}", schema_generator=_ComponentSchema
    )
    return schemas["$defs"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(status: str, description: str) -> dict:
    response = _json(_ref("ErrorResponse"), description)
    if status == "429":
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}}
    return response


def _operation(summary: str, ok: tuple[str, dict], errors: dict[str, str], **fields) -> dict:
    """One operation: its success response, its error responses (status: description) and any
    other OpenAPI operation fields (parameters, requestBody, security, description)."""
    responses = {ok[0]: ok[1], **{status: _error(status, text) for status, text in errors.items()}}
    return {"summary": summary, **fields, "responses": responses}


def _path_id(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}, "description": description}


def _query(name: str, schema: dict, description: str | None = None) -> dict:
    param = {"name": name, "in": "query", "schema": schema}
    return {**param, "description": description} if description else param


def _multipart(required: list[str], properties: dict) -> dict:
    schema = {"type": "object", "required": required, "properties": properties}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}


PUBLIC = {"security": []}
AUTH = {"401": "Missing, unknown or revoked API key"}
ERRORS = {**AUTH, "400": "Invalid request", "404": "Not found (or another tenant's)"}
TOO_LARGE = {"413": "Too many bytes or lines"}
LIMITED = {"429": "Over the tenant's limit of active jobs or queued requests"}

JOB_ID = _path_id("job_id", "A job id (batch_...)")
BATCH_ID = _path_id("batch_id", "A batch id (batch_...)")
FILE_ID = _path_id("file_id", "A file id (file-...)")
AFTER = _query("after", {"type": "string"}, "Cursor: the id of the last object of the previous page")


def _limit(default: int, maximum: int) -> dict:
    return _query("limit", {"type": "integer", "minimum": 1, "maximum": maximum, "default": default})


JSONL_FILE = {"type": "string", "format": "binary", "description": "JSONL, one OpenAI batch request a line"}
JSONL = {"application/x-ndjson": {"schema": {"type": "string"}}}
PROMETHEUS_TEXT = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
PARQUET = {"application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}}}


def _meta_paths() -> dict:
    any_object = ("200", _json({"type": "object"}))
    return {
        "/openapi.json": {"get": _operation("This document", any_object, {}, **PUBLIC)},
        "/healthz": {"get": _operation("Liveness and database check", any_object, {}, **PUBLIC)},
        "/readyz": {
            "get": _operation(
                "Readiness: database and storage (status ok or degraded: storage not writable, or low on space)",
                any_object, {}, **PUBLIC,
            )  # fmt: skip
        },
        "/metrics": {"get": _operation("Prometheus metrics", ("200", PROMETHEUS_TEXT), {}, **PUBLIC)},
        "/v1/models": {
            "get": _operation("Models this deployment serves", ("200", _json(_ref("ModelList"))), AUTH)
        },
    }


INVALID_LINES = {"type": "string", "enum": list(INVALID_LINE_POLICIES)}
PRIORITY = {"type": "integer", "minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY, "default": 0,
            "description": "lower is served first, among the tenant's jobs (vLLM's meaning)"}  # fmt: skip


def _create_job() -> dict:
    raw_body = "With a raw body: "
    body = _multipart(
        ["file", "model"],
        {
            "file": JSONL_FILE,
            "model": {"type": "string"},
            "defaults": {"type": "string", "description": "JSON object"},
            "metadata": {"type": "string", "description": "JSON object of string pairs"},
            "on_invalid_lines": INVALID_LINES,
            "priority": PRIORITY,
        },
    )
    body["content"]["application/x-ndjson"] = {"schema": JSONL_FILE}
    return _operation(
        "Create a job from a JSONL upload",
        ("201", _json(_ref("Job"), "Created")),
        {**ERRORS, **LIMITED, **TOO_LARGE, "415": "Unsupported content type"},
        description="Answers at once, `validating`; each line is then validated in the background and the "
        "valid ones start running while the rest is read. Bad lines become errors with their line numbers "
        "(`on_invalid_lines=fail`: the job fails instead). A job whose every line is bad fails.",
        parameters=[
            _query("model", {"type": "string"}, raw_body + "the model serving every line"),
            _query("defaults", {"type": "string"}, raw_body + "JSON object of default body fields"),
            _query("metadata", {"type": "string"}, raw_body + f"JSON object of up to {METADATA_PAIRS} string pairs"),
            _query("on_invalid_lines", INVALID_LINES, raw_body + "skip (the default) or fail"),
            _query("priority", PRIORITY, raw_body + "the job's priority"),
        ],
        requestBody=body,
    )


def _job_paths() -> dict:
    job = ("200", _json(_ref("Job")))
    return {
        "/v1/jobs": {
            "post": _create_job(),
            "get": _operation(
                "List jobs, newest first",
                ("200", _json(_ref("JobList"))),
                ERRORS,
                parameters=[_query("status", {"enum": list(JOB_STATUSES)}), _limit(20, 100), AFTER],
            ),
        },
        "/v1/jobs/{job_id}": {
            "get": _operation("A job's status, counts, usage and progress", job, ERRORS, parameters=[JOB_ID])
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": _operation(
                "Cancel a job; what finished stays downloadable",
                job,
                {**ERRORS, "409": "The job already finished"},
                parameters=[JOB_ID],
            )
        },
        "/v1/jobs/{job_id}/results": {
            "get": _operation(
                "The job's results: Parquet, or OpenAI output lines with ?format=jsonl",
                ("200", {"description": "The results", "content": {**PARQUET, **JSONL}}),
                {**ERRORS, "409": "The job has not finished"},
                parameters=[JOB_ID, _query("format", {"enum": ["parquet", "jsonl"], "default": "parquet"})],
            )
        },
        "/v1/jobs/{job_id}/errors": {
            "get": _operation(
                "OpenAI-style error lines (validation errors at once, all errors when finished)",
                ("200", {"description": "Error lines", "content": JSONL}),
                ERRORS,
                parameters=[JOB_ID],
            )
        },
    }


def _file_paths() -> dict:
    file = ("200", _json(_ref("File")))
    return {
        "/v1/files": {
            "post": _operation(
                "Upload a batch input file (OpenAI)",
                file,
                {**ERRORS, **TOO_LARGE},
                description="Held to the tenant's file quota (count and bytes); DELETE frees it.",
                requestBody=_multipart(
                    ["file", "purpose"],
                    {
                        "file": JSONL_FILE,
                        "purpose": {"const": "batch"},
                        "expires_after[anchor]": {"const": "created_at"},
                        "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2592000},
                    },
                ),
            ),
            "get": _operation(
                "List files (OpenAI)",
                ("200", _json(_ref("FileList"))),
                ERRORS,
                parameters=[
                    _query("purpose", {"type": "string"}),
                    _limit(10_000, 10_000),
                    AFTER,
                    _query("order", {"enum": ["asc", "desc"], "default": "desc"}, "By created_at"),
                ],
            ),
        },
        "/v1/files/{file_id}": {
            "get": _operation("A file (OpenAI)", file, ERRORS, parameters=[FILE_ID]),
            "delete": _operation(
                "Delete a file and its content (OpenAI)",
                ("200", _json(_ref("FileDeleted"))),
                {**ERRORS, "409": "The file is the input of a batch that has not finished"},
                parameters=[FILE_ID],
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": _operation(
                "A file's content (OpenAI)",
                ("200", {"description": "The file", "content": {"application/jsonl": {"schema": {"type": "string"}}}}),
                ERRORS,
                parameters=[FILE_ID],
            )
        },
    }


def _batch_paths() -> dict:
    batch = ("200", _json(_ref("Batch")))
    create_body = {"required": True, "content": {"application/json": {"schema": _ref("BatchCreate")}}}
    return {
        "/v1/batches": {
            "post": _operation(
                "Create a batch from an uploaded file (OpenAI)",
                batch,
                {**ERRORS, **LIMITED, "413": "Body over 64 KiB"},
                requestBody=create_body,
            ),
            "get": _operation(
                "List batches, newest first (OpenAI)",
                ("200", _json(_ref("BatchList"))),
                ERRORS,
                parameters=[_limit(20, 100), AFTER],
            ),
        },
        "/v1/batches/{batch_id}": {"get": _operation("A batch (OpenAI)", batch, ERRORS, parameters=[BATCH_ID])},
        "/v1/batches/{batch_id}/cancel": {
            "post": _operation(
                "Cancel a batch (OpenAI)",
                batch,
                {**ERRORS, "409": "The batch already finished"},
                parameters=[BATCH_ID],
            )
        },
    }


@functools.cache
def openapi_document() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedbatch",
            "version": "0.1.0",
            "description": "Batch inference: a native jobs API and an OpenAI Batch-compatible API.",
        },
        "paths": {**_meta_paths(), **_job_paths(), **_file_paths(), **_batch_paths()},
        "components": {
            "schemas": component_schemas(),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "An API key (pb-...)"}},
        },
        "security": [{"apiKey": []}],
    }
