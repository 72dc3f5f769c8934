"""The OpenAPI 3.1 document served at /openapi.json. A test checks it against the app's routes."""

from __future__ import annotations

import functools

from store.models import JOB_STATUSES


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path_id(name: str, description: str) -> dict:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": description,
    }


_UNAUTHORIZED = {"401": _json(_ref("Error"), "Missing, unknown or revoked API key")}
_LIMITED = {
    "429": {
        **_json(_ref("Error"), "Over the tenant's limit of active jobs or queued requests"),
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}},
    }
}
_ERRORS = {
    **_UNAUTHORIZED,
    "400": _json(_ref("Error"), "Invalid request"),
    "404": _json(_ref("Error"), "Not found (or another tenant's)"),
}
_TS = {"type": ["integer", "null"], "description": "Unix seconds"}
_LIMIT = {
    "name": "limit",
    "in": "query",
    "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
}
_AFTER = {
    "name": "after",
    "in": "query",
    "schema": {"type": "string"},
    "description": "Cursor: the id of the last object of the previous page",
}
_METADATA = {
    "type": ["object", "null"],
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
    "description": "Up to 16 string pairs (OpenAI's metadata)",
}
_JSONL_BODY = {"type": "string", "format": "binary", "description": "JSONL, one OpenAI batch request a line"}


def _list_of(item: str) -> dict:
    return {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref(item)},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": {"type": "boolean"},
        },
    }


_SCHEMAS = {
    "Error": {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "LineError": {
        "type": "object",
        "properties": {
            "code": {"type": "string"},
            "message": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "line": {"type": ["integer", "null"]},
        },
    },
    "File": {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "file"},
            "bytes": {"type": "integer"},
            "created_at": {"type": "integer"},
            "filename": {"type": "string"},
            "purpose": {"enum": ["batch", "batch_output"]},
            "status": {"enum": ["uploaded", "processed", "error"]},
            "expires_at": _TS,
            "status_details": {"type": ["string", "null"]},
        },
    },
    "Batch": {
        "type": "object",
        "required": [
            "id",
            "object",
            "endpoint",
            "input_file_id",
            "completion_window",
            "status",
            "created_at",
        ],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "batch"},
            "endpoint": {"type": "string"},
            "model": {"type": ["string", "null"]},
            "errors": {
                "type": ["object", "null"],
                "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": _ref("LineError")},
                },
            },
            "input_file_id": {"type": "string"},
            "completion_window": {"type": "string"},
            "status": {"enum": list(JOB_STATUSES)},
            "output_file_id": {"type": ["string", "null"]},
            "error_file_id": {"type": ["string", "null"]},
            **{
                k: _TS
                for k in (
                    "created_at",
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
            "request_counts": {
                "type": "object",
                "properties": {
                    "total": {"type": "integer"},
                    "completed": {"type": "integer"},
                    "failed": {"type": "integer"},
                },
            },
            "usage": {
                "type": "object",
                "properties": {
                    "input_tokens": {"type": "integer"},
                    "output_tokens": {"type": "integer"},
                    "total_tokens": {"type": "integer"},
                    "input_tokens_details": {"type": "object"},
                    "output_tokens_details": {"type": "object"},
                },
            },
            "metadata": _METADATA,
        },
    },
    "Job": {
        "type": "object",
        "required": ["id", "object", "status", "request_counts", "usage", "progress", "created_at"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "job"},
            "status": {"enum": list(JOB_STATUSES)},
            "model": {"type": ["string", "null"]},
            "endpoint": {"type": ["string", "null"]},
            "defaults": {"type": ["object", "null"]},
            "metadata": _METADATA,
            "input_file_id": {"type": ["string", "null"]},
            "output_file_id": {"type": ["string", "null"]},
            "error_file_id": {"type": ["string", "null"]},
            "request_counts": {
                "type": "object",
                "properties": {
                    k: {"type": "integer"}
                    for k in ("total", "valid", "invalid", "completed", "failed", "cancelled")
                },
            },
            "usage": {
                "type": "object",
                "properties": {
                    k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")
                },
            },
            "progress": {
                "type": "number",
                "minimum": 0,
                "maximum": 1,
                "description": "Fraction of valid requests whose shard has finished",
            },
            "shards": {"type": "integer"},
            "errors": {"type": "array", "items": _ref("LineError"), "description": "The first line errors"},
            **{
                k: _TS
                for k in (
                    "created_at",
                    "in_progress_at",
                    "expires_at",
                    "finalizing_at",
                    "completed_at",
                    "failed_at",
                    "expired_at",
                    "cancelling_at",
                    "cancelled_at",
                )
            },
        },
    },
    "FileList": _list_of("File"),
    "BatchList": _list_of("Batch"),
    "JobList": _list_of("Job"),
}

_JOB_ID = _path_id("job_id", "A job id (batch_...)")
_BATCH_ID = _path_id("batch_id", "A batch id (batch_...)")
_FILE_ID = _path_id("file_id", "A file id (file-...)")
_NOT_READY = {"409": _json(_ref("Error"), "The job has not finished")}


def _paths() -> dict:
    jsonl = {"application/x-ndjson": {"schema": {"type": "string"}}}
    return {
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "security": [],
                "responses": {"200": _json({"type": "object"})},
            }
        },
        "/healthz": {
            "get": {
                "summary": "Liveness and database check",
                "security": [],
                "responses": {"200": _json({"type": "object"})},
            }
        },
        "/v1/models": {
            "get": {
                "summary": "Models this deployment serves",
                "responses": {"200": _json({"type": "object"}), **_UNAUTHORIZED},
            }
        },
        "/v1/jobs": {
            "post": {
                "summary": "Create a job from a JSONL upload",
                "description": "Each line is validated; bad lines become errors with their line numbers. "
                "A job whose every line is bad fails.",
                "parameters": [
                    {
                        "name": "model",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "With a raw body: the model serving every line",
                    },
                    {
                        "name": "defaults",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "With a raw body: JSON object of default body fields",
                    },
                    {
                        "name": "metadata",
                        "in": "query",
                        "schema": {"type": "string"},
                        "description": "With a raw body: JSON object of metadata (up to 16 string pairs)",
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "required": ["file", "model"],
                                "properties": {
                                    "file": _JSONL_BODY,
                                    "model": {"type": "string"},
                                    "defaults": {"type": "string", "description": "JSON object"},
                                    "metadata": {"type": "string", "description": "JSON object of string pairs"},
                                },
                            }
                        },
                        "application/x-ndjson": {"schema": _JSONL_BODY},
                    },
                },
                "responses": {
                    "201": _json(_ref("Job"), "Created"),
                    **_ERRORS,
                    **_LIMITED,
                    "413": _json(_ref("Error"), "Too many bytes or lines"),
                    "415": _json(_ref("Error"), "Unsupported content type"),
                },
            },
            "get": {
                "summary": "List jobs, newest first",
                "parameters": [
                    {"name": "status", "in": "query", "schema": {"enum": list(JOB_STATUSES)}},
                    _LIMIT,
                    _AFTER,
                ],
                "responses": {"200": _json(_ref("JobList")), **_ERRORS},
            },
        },
        "/v1/jobs/{job_id}": {
            "get": {
                "summary": "A job's status, counts, usage and progress",
                "parameters": [_JOB_ID],
                "responses": {"200": _json(_ref("Job")), **_ERRORS},
            }
        },
        "/v1/jobs/{job_id}/cancel": {
            "post": {
                "summary": "Cancel a job; what finished stays downloadable",
                "parameters": [_JOB_ID],
                "responses": {
                    "200": _json(_ref("Job")),
                    **_ERRORS,
                    "409": _json(_ref("Error"), "The job already finished"),
                },
            }
        },
        "/v1/jobs/{job_id}/results": {
            "get": {
                "summary": "The job's results: Parquet, or OpenAI output lines with ?format=jsonl",
                "parameters": [
                    _JOB_ID,
                    {
                        "name": "format",
                        "in": "query",
                        "schema": {"enum": ["parquet", "jsonl"], "default": "parquet"},
                    },
                ],
                "responses": {
                    "200": {
                        "description": "The results",
                        "content": {
                            "application/vnd.apache.parquet": {
                                "schema": {"type": "string", "format": "binary"}
                            },
                            **jsonl,
                        },
                    },
                    **_ERRORS,
                    **_NOT_READY,
                },
            }
        },
        "/v1/jobs/{job_id}/errors": {
            "get": {
                "summary": "OpenAI-style error lines (validation errors at once, all errors when finished)",
                "parameters": [_JOB_ID],
                "responses": {"200": {"description": "Error lines", "content": jsonl}, **_ERRORS},
            }
        },
        "/v1/files": {
            "post": {
                "summary": "Upload a batch input file (OpenAI)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "required": ["file", "purpose"],
                                "properties": {"file": _JSONL_BODY, "purpose": {"const": "batch"}},
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json(_ref("File")),
                    **_ERRORS,
                    "413": _json(_ref("Error"), "Too many bytes or lines"),
                },
            },
            "get": {
                "summary": "List files (OpenAI)",
                "parameters": [
                    {"name": "purpose", "in": "query", "schema": {"type": "string"}},
                    {**_LIMIT, "schema": {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}},
                    _AFTER,
                ],
                "responses": {"200": _json(_ref("FileList")), **_ERRORS},
            },
        },
        "/v1/files/{file_id}": {
            "get": {
                "summary": "A file (OpenAI)",
                "parameters": [_FILE_ID],
                "responses": {"200": _json(_ref("File")), **_ERRORS},
            }
        },
        "/v1/files/{file_id}/content": {
            "get": {
                "summary": "A file's content (OpenAI)",
                "parameters": [_FILE_ID],
                "responses": {
                    "200": {
                        "description": "The file",
                        "content": {"application/jsonl": {"schema": {"type": "string"}}},
                    },
                    **_ERRORS,
                },
            }
        },
        "/v1/batches": {
            "post": {
                "summary": "Create a batch from an uploaded file (OpenAI)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["input_file_id", "endpoint", "completion_window"],
                                "properties": {
                                    "input_file_id": {"type": "string"},
                                    "endpoint": {"enum": ["/v1/chat/completions", "/v1/completions"]},
                                    "completion_window": {"const": "24h"},
                                    "metadata": _METADATA,
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json(_ref("Batch")),
                    **_ERRORS,
                    **_LIMITED,
                    "413": _json(_ref("Error"), "Body over 64 KiB"),
                },
            },
            "get": {
                "summary": "List batches, newest first (OpenAI)",
                "parameters": [_LIMIT, _AFTER],
                "responses": {"200": _json(_ref("BatchList")), **_ERRORS},
            },
        },
        "/v1/batches/{batch_id}": {
            "get": {
                "summary": "A batch (OpenAI)",
                "parameters": [_BATCH_ID],
                "responses": {"200": _json(_ref("Batch")), **_ERRORS},
            }
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {
                "summary": "Cancel a batch (OpenAI)",
                "parameters": [_BATCH_ID],
                "responses": {
                    "200": _json(_ref("Batch")),
                    **_ERRORS,
                    "409": _json(_ref("Error"), "The batch already finished"),
                },
            }
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
        "paths": _paths(),
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "An API key (pb-...)"}},
        },
        "security": [{"apiKey": []}],
    }
