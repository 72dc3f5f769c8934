"""The OpenAI Batch-compatible API: /v1/files and /v1/batches."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from api.auth import current_tenant
from api.errors import ApiError
from api.routes.common import (
    cached_job_body,
    check_content_length,
    limit_param,
    list_body,
    metadata_param,
    parse_json,
    reject_nul_bytes,
    send_stored,
    settings,
    upload_chunks,
    upload_filename,
)
from api.serializers import batch_object, file_object
from store import lifecycle

bp = Blueprint("openai_batch", __name__)
bp.before_request(reject_nul_bytes)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_JSON_BODY = 1 << 16


def _batch_json(job):
    return batch_object(job, lifecycle.job_progress(settings(), job))


@bp.post("/v1/files")
def create_file():
    check_content_length()
    upload = request.files.get("file")
    if upload is None:
        raise ApiError(400, "missing multipart field 'file'", param="file")
    purpose = request.form.get("purpose")
    if purpose != "batch":
        raise ApiError(400, "only purpose 'batch' is supported", param="purpose")
    record = lifecycle.store_upload(
        settings(),
        upload_chunks(upload.stream),
        tenant=current_tenant(),
        filename=upload_filename(upload),
        purpose="batch",
    )
    return jsonify(file_object(record))


@bp.get("/v1/files")
def list_files():
    records, has_more = lifecycle.list_files(
        settings(),
        current_tenant(),
        purpose=request.args.get("purpose") or None,
        limit=limit_param(default=100, maximum=10_000),
        after=request.args.get("after"),
    )
    return jsonify(list_body([file_object(r) for r in records], has_more))


@bp.get("/v1/files/<file_id>")
def get_file(file_id: str):
    return jsonify(file_object(lifecycle.get_file(settings(), current_tenant(), file_id)))


@bp.get("/v1/files/<file_id>/content")
def get_file_content(file_id: str):
    record = lifecycle.get_file(settings(), current_tenant(), file_id)
    return send_stored(record.storage_key, "application/jsonl", record.filename)


@bp.post("/v1/batches")
def create_batch():
    raw = request.stream.read(MAX_JSON_BODY + 1)
    if len(raw) > MAX_JSON_BODY:
        raise ApiError(413, f"a batch request body is at most {MAX_JSON_BODY} bytes", code="payload_too_large")
    body = parse_json(raw, "the request body")
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object body")
    input_file_id = body.get("input_file_id")
    if not input_file_id:
        raise ApiError(400, "input_file_id is required", param="input_file_id")
    if not isinstance(input_file_id, str) or "\x00" in input_file_id:
        raise ApiError(400, "input_file_id must be a file id (a string)", param="input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if window != "24h":
        raise ApiError(400, "completion_window must be '24h'", param="completion_window")
    metadata = metadata_param(body.get("metadata"))
    tenant = current_tenant()
    input_file = lifecycle.get_file(settings(), tenant, input_file_id)
    if input_file.purpose != "batch":
        raise ApiError(400, f"file {input_file_id} does not have purpose 'batch'", param="input_file_id")
    job = lifecycle.create_job(
        settings(), input_file, tenant=tenant, endpoint=endpoint, metadata=metadata, completion_window=window
    )
    return jsonify(_batch_json(job))


@bp.get("/v1/batches")
def list_batches():
    jobs, has_more = lifecycle.list_jobs(
        settings(), current_tenant(), limit=limit_param(), after=request.args.get("after")
    )
    return jsonify(list_body([_batch_json(job) for job in jobs], has_more))


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str):
    return jsonify(cached_job_body("batch", current_tenant(), batch_id, batch_object))


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return jsonify(_batch_json(lifecycle.cancel_job(settings(), current_tenant(), batch_id)))
