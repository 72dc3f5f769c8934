"""The OpenAI Batch-compatible API: /v1/files and /v1/batches."""

from __future__ import annotations

from flask import Blueprint, jsonify, request
from pydantic import ValidationError

from api.auth import current_tenant
from api.errors import ApiError
from api.inputs import BatchListQuery, FileListQuery, FileUpload
from api.objects import BATCH_ENDPOINTS, COMPLETION_WINDOWS, BatchCreate, BatchList, FileDeleted, FileList
from api.platform import settings, validate_in_background
from api.routes.params import (
    declared,
    expires_after_param,
    expires_after_value,
    invalid,
    invalid_lines_param,
    metadata_param,
    parse_json,
    priority_param,
    query,
    reject_nul_bytes,
)
from api.routes.responses import cached_job_body, send_object, send_stored
from api.routes.uploads import check_content_length, upload_chunks, upload_filename
from api.serializers import batch_object, file_object, page
from store.errors import NotFound
from store.filestore import files
from store.lifecycle import cancel, jobs
from store.lifecycle.progress import job_progress

bp = Blueprint("openai_batch", __name__)
bp.before_request(reject_nul_bytes)

MAX_JSON_BODY = 1 << 16


def _batch(job):
    return batch_object(job, job_progress(settings(), job))


@bp.post("/v1/files")
def create_file():
    check_content_length()
    files.check_upload_allowed(settings(), current_tenant())  # before the body is read
    upload = request.files.get("file")
    if upload is None:
        raise ApiError(400, "missing multipart field 'file'", param="file")
    purpose = request.form.get("purpose")
    if purpose != "batch":
        raise ApiError(400, "only purpose 'batch' is supported", param="purpose")
    expires_after = expires_after_param(request.form)
    declared(FileUpload, request.form)  # what the document publishes, exactly (the JSON part expires_after)
    record = files.store_upload(
        settings(),
        upload_chunks(upload.stream),
        tenant=current_tenant(),
        filename=upload_filename(upload),
        purpose="batch",
        expires_after_s=expires_after,
    )
    return send_object(file_object(record))


@bp.get("/v1/files")
def list_files():
    params = query(FileListQuery)
    records, has_more = files.list_files(
        settings(),
        current_tenant(),
        purpose=params.purpose or None,
        limit=params.limit,
        after=params.after,
        ascending=params.order == "asc",
    )
    return send_object(page(FileList, [file_object(r) for r in records], has_more))


@bp.get("/v1/files/<file_id>")
def get_file(file_id: str):
    return send_object(file_object(files.get_file(settings(), current_tenant(), file_id)))


@bp.delete("/v1/files/<file_id>")
def delete_file(file_id: str):
    record = files.delete_file(settings(), current_tenant(), file_id)
    return send_object(FileDeleted(id=record.id, deleted=True))


@bp.get("/v1/files/<file_id>/content")
def get_file_content(file_id: str):
    record = files.get_file(settings(), current_tenant(), file_id)
    return send_stored(record.storage_key, "application/jsonl", record.filename)


def _batch_request() -> dict:
    """The body of POST /v1/batches, checked field by field (api.objects.BatchCreate documents it)
    so that each mistake gets OpenAI's kind of message and names its parameter."""
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
    if endpoint not in BATCH_ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise ApiError(400, "completion_window must be '24h'", param="completion_window")
    fields = {
        "input_file_id": input_file_id,
        "endpoint": endpoint,
        "completion_window": window,
        "metadata": metadata_param(body.get("metadata")),
        "output_expires_after_s": expires_after_value(body.get("output_expires_after"), "output_expires_after"),
        # OpenAI fails a file with invalid lines; "skip" runs the valid ones and reports the rest
        "on_invalid_lines": invalid_lines_param(body.get("on_invalid_lines"), default="fail"),
        # pagedbatch's extension (the openai client sends it with extra_body): lower first, within the tenant
        "priority": priority_param(body.get("priority")),
    }
    try:  # the declaration the document publishes has the last word
        BatchCreate.model_validate(body, strict=True)
    except ValidationError as exc:
        raise invalid(exc) from None
    return fields


@bp.post("/v1/batches")
def create_batch():
    body = _batch_request()
    cfg, tenant = settings(), current_tenant()
    try:
        input_file = files.get_file(cfg, tenant, body.pop("input_file_id"))
    except NotFound as exc:
        raise NotFound(exc.message, param="input_file_id") from None
    if input_file.purpose != "batch":
        raise ApiError(400, f"file {input_file.id} does not have purpose 'batch'", param="input_file_id")
    job, owner = jobs.create_job(cfg, input_file, tenant=tenant, **body)
    validate_in_background(job.id, owner)
    return send_object(_batch(job))


@bp.get("/v1/batches")
def list_batches():
    params = query(BatchListQuery)
    found, has_more = jobs.list_jobs(settings(), current_tenant(), limit=params.limit, after=params.after)
    return send_object(page(BatchList, [_batch(job) for job in found], has_more))


@bp.get("/v1/batches/<batch_id>")
def get_batch(batch_id: str):
    return jsonify(cached_job_body("batch", current_tenant(), batch_id, batch_object))


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str):
    return send_object(_batch(cancel.cancel_job(settings(), current_tenant(), batch_id)))
