"""The OpenAPI 3.1 document served at /openapi.json.

Every schema in it is generated from the pydantic declarations the server validates with and serializes
from (api.spec.openapi_schemas): the objects sent (api.objects), the JSON bodies, query parameters and forms
accepted (api.objects.BatchCreate, api.inputs), so a published constraint is an enforced one. `model`
lists the models this deployment serves. Links lead from each create to the operations on what it made
(client generators and schemathesis' stateful tests follow them). A test checks the paths against the
app's routes.
"""

from __future__ import annotations

import functools

from api.inputs import (
    BatchListQuery,
    FileListQuery,
    FileUpload,
    JobListQuery,
    JobOptions,
    JobUpload,
    ResultsQuery,
)
from api.spec.openapi_events import upload_paths, webhook_paths
from api.spec.openapi_ops import AUTH, ERRORS, LIMITED, PUBLIC, TOO_LARGE
from api.spec.openapi_ops import json_response as _json
from api.spec.openapi_ops import operation as _operation
from api.spec.openapi_ops import ref as _ref
from api.spec.openapi_ops import with_links as _links
from api.spec.openapi_schemas import component_schemas, multipart_body, path_id, query_parameters

JOB_ID = path_id("job_id", "A job id (batch_...)")
BATCH_ID = path_id("batch_id", "A batch id (batch_...)")
FILE_ID = path_id("file_id", "A file id (file-...)")
JSONL = {"application/x-ndjson": {"schema": {"type": "string"}}}
PROMETHEUS_TEXT = {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
PARQUET = {"application/vnd.apache.parquet": {"schema": {"type": "string", "format": "binary"}}}
JOB_LINKS = {
    "getJob": "job_id",
    "cancelJob": "job_id",
    "getJobResults": "job_id",
    "getJobErrors": "job_id",
    "getBatch": "batch_id",
}
BATCH_LINKS = {"getBatch": "batch_id", "cancelBatch": "batch_id", "getJob": "job_id"}
FILE_LINKS = {"getFile": "file_id", "getFileContent": "file_id", "deleteFile": "file_id"}


def _list(operation_id: str, summary: str, list_schema: str, query) -> dict:
    """A GET of a collection, paged by the query parameters of the pydantic model `query`."""
    return _operation(
        operation_id, summary, ("200", _json(_ref(list_schema))), ERRORS, parameters=query_parameters(query)
    )


def _cancel(operation_id: str, summary: str, answer: tuple, noun: str, id_parameter: dict) -> dict:
    """A POST that cancels the `noun` named in the path; 409 once it has finished."""
    conflicts = {**ERRORS, "409": f"The {noun} already finished"}
    return _operation(operation_id, summary, answer, conflicts, parameters=[id_parameter])


def _meta_paths() -> dict:
    any_object = ("200", _json({"type": "object"}))
    return {
        "/openapi.json": {"get": _operation("getOpenapi", "This document", any_object, {}, **PUBLIC)},
        "/healthz": {"get": _operation("getHealth", "Liveness and database check", any_object, {}, **PUBLIC)},
        "/readyz": {
            "get": _operation(
                "getReadiness",
                "Readiness: database and storage (status ok or degraded: storage not writable, or low on space)",
                any_object,
                {},
                **PUBLIC,
            )
        },
        "/metrics": {"get": _operation("getMetrics", "Prometheus metrics", ("200", PROMETHEUS_TEXT), {}, **PUBLIC)},
        "/v1/models": {
            "get": _operation("listModels", "Models this deployment serves", ("200", _json(_ref("ModelList"))), AUTH)
        },
    }


def _create_job(models: tuple[str, ...]) -> dict:
    model = {"type": "string", "enum": list(models)} if models else query_parameters(JobOptions)[0]["schema"]
    create = _operation(
        "createJob",
        "Create a job from a JSONL upload",
        ("201", _links(_json(_ref("Job"), "Created"), JOB_LINKS)),
        {**ERRORS, **LIMITED, **TOO_LARGE, "415": "Unsupported content type"},
        description="Answers at once, `validating`; each line is then validated in the background and the "
        "valid ones start running while the rest is read. Bad lines become errors with their line numbers "
        "(`on_invalid_lines=fail`: the job fails instead). A job whose every line is bad fails. The options "
        "go as form fields beside the file. The JSONL may also be the whole body (`Content-Type: "
        "application/x-ndjson`), with the same options as query parameters (`model` required; `defaults` "
        "and `metadata` as JSON text); with a multipart body, query parameters are checked but not used. "
        "`defaults` nests at most 32 levels. With `dry_run=true` nothing is created: the file is validated "
        "and planned as a job's would be and the answer (200) is its quote: lines, prompt tokens, the tokens "
        "the prefix plan expects from the cache, the most completion tokens, and run and finish time estimated "
        "from the workers' measured rates and the queue ahead.",
        requestBody=multipart_body(JobUpload, closed=True, model=model),
    )
    create["responses"] = {"200": _json(_ref("JobQuote"), "dry_run=true: the file's quote"), **create["responses"]}
    return create


def _job_paths(models: tuple[str, ...]) -> dict:
    job = ("200", _json(_ref("Job")))
    return {
        "/v1/jobs": {
            "post": _create_job(models),
            "get": _list("listJobs", "List jobs, newest first", "JobList", JobListQuery),
        },
        "/v1/jobs/{job_id}": {
            "get": _operation("getJob", "A job's status, counts, usage and progress", job, ERRORS, parameters=[JOB_ID])
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": _cancel("cancelJob", "Cancel a job; what finished stays downloadable", job, "job", JOB_ID)
        },
        "/v1/jobs/{job_id}/results": {
            "get": _operation(
                "getJobResults",
                "The job's results: Parquet, OpenAI output lines with ?format=jsonl, or with ?after the lines "
                "completed so far (running or not) as a JSON page",
                (
                    "200",
                    {
                        "description": "The results",
                        "content": {**PARQUET, **JSONL, "application/json": {"schema": _ref("ResultLines")}},
                    },
                ),
                {**ERRORS, "409": "The job has not finished (without ?after)"},
                parameters=[JOB_ID, *query_parameters(ResultsQuery)],
            )
        },
        "/v1/jobs/{job_id}/errors": {
            "get": _operation(
                "getJobErrors",
                "OpenAI-style error lines (validation errors at once, all errors when finished)",
                ("200", {"description": "Error lines", "content": JSONL}),
                ERRORS,
                parameters=[JOB_ID],
            )
        },
    }


def _file_paths() -> dict:
    file = ("200", _json(_ref("File")))
    create_batch = {"operationId": "createBatch", "requestBody": {"input_file_id": "$response.body#/id"}}
    return {
        "/v1/files": {
            "post": _operation(
                "createFile",
                "Upload a batch input file (OpenAI)",
                ("200", _links(file[1], FILE_LINKS, createBatch=create_batch)),
                {**ERRORS, **TOO_LARGE},
                description="Held to the tenant's file quota (count and bytes); DELETE frees it. `expires_after` "
                "is a JSON part, or the form fields `expires_after[anchor]` and `expires_after[seconds]` that "
                "OpenAI's clients send.",
                requestBody=multipart_body(FileUpload),
            ),
            "get": _list("listFiles", "List files (OpenAI)", "FileList", FileListQuery),
        },
        "/v1/files/{file_id}": {
            "get": _operation("getFile", "A file (OpenAI)", file, ERRORS, parameters=[FILE_ID]),
            "delete": _operation(
                "deleteFile",
                "Delete a file and its content (OpenAI)",
                ("200", _json(_ref("FileDeleted"))),
                {**ERRORS, "409": "The file is the input of a batch that has not finished"},
                parameters=[FILE_ID],
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": _operation(
                "getFileContent",
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
                "createBatch",
                "Create a batch from an uploaded file (OpenAI)",
                ("200", _links(batch[1], BATCH_LINKS)),
                {**ERRORS, **LIMITED, "413": "Body over 64 KiB"},
                requestBody=create_body,
            ),
            "get": _list("listBatches", "List batches, newest first (OpenAI)", "BatchList", BatchListQuery),
        },
        "/v1/batches/{batch_id}": {
            "get": _operation("getBatch", "A batch (OpenAI)", batch, ERRORS, parameters=[BATCH_ID])
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _cancel("cancelBatch", "Cancel a batch (OpenAI)", batch, "batch", BATCH_ID)
        },
    }


@functools.lru_cache(maxsize=16)
def openapi_document(models: tuple[str, ...] = (), max_upload_bytes: int | None = None) -> dict:
    """The document for a deployment serving `models` (the values `model` may take) with uploads of at most
    `max_upload_bytes` (the most an upload in parts may declare)."""
    schemas = component_schemas()
    if max_upload_bytes is not None:
        upload = schemas["UploadCreate"]
        bytes_ = {**upload["properties"]["bytes"], "maximum": max_upload_bytes}
        schemas = {**schemas, "UploadCreate": {**upload, "properties": {**upload["properties"], "bytes": bytes_}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "pagedbatch",
            "version": "0.1.0",
            "description": "Batch inference: a native jobs API and an OpenAI Batch-compatible API.",
        },
        "paths": {
            **_meta_paths(),
            **_job_paths(models),
            **_file_paths(),
            **_batch_paths(),
            **upload_paths(),
            **webhook_paths(),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "An API key (pb-...)"}},
        },
        "security": [{"apiKey": []}],
    }
