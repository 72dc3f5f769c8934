"""The native API: /v1/jobs."""

from __future__ import annotations

from flask import Blueprint, jsonify, request

from api.auth import current_tenant
from api.errors import ApiError
from api.routes.common import (
    cached_job_body,
    check_content_length,
    json_param,
    limit_param,
    list_body,
    metadata_param,
    reject_nul_bytes,
    send_fs,
    send_lines,
    send_stored,
    settings,
    upload_chunks,
    upload_filename,
)
from api.serializers import job_object
from store import lifecycle
from store.models import JOB_STATUSES, TERMINAL_STATUSES

bp = Blueprint("jobs", __name__)
bp.before_request(reject_nul_bytes)

NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "text/plain")


def _job_json(job):
    return job_object(job, lifecycle.job_progress(settings(), job))


@bp.post("/v1/jobs")
def create_job():
    """A JSONL upload (multipart field `file`, or a raw application/x-ndjson body) becomes a job."""
    check_content_length()
    cfg = settings()
    tenant = current_tenant()
    if request.mimetype == "multipart/form-data":
        upload = request.files.get("file")
        if upload is None:
            raise ApiError(400, "missing multipart field 'file'", param="file")
        fields = request.form
        chunks, filename = upload_chunks(upload.stream), upload_filename(upload)
    elif request.mimetype in NDJSON_TYPES:
        fields = request.args
        chunks, filename = upload_chunks(request.stream), "input.jsonl"
    else:
        raise ApiError(415, "send the JSONL as multipart/form-data (field 'file') or as application/x-ndjson")
    model = fields.get("model") or request.args.get("model")
    if not model:
        raise ApiError(400, "model is required", param="model")
    defaults = json_param(fields.get("defaults") or request.args.get("defaults"), "defaults")
    metadata = metadata_param(fields.get("metadata") or request.args.get("metadata"))
    input_file = lifecycle.store_upload(cfg, chunks, tenant=tenant, filename=filename, purpose="batch")
    job = lifecycle.create_job(
        cfg, input_file, tenant=tenant, model=model, defaults=defaults, metadata=metadata
    )
    return jsonify(_job_json(job)), 201


@bp.get("/v1/jobs")
def list_jobs():
    status = request.args.get("status") or None
    if status is not None and status not in JOB_STATUSES:
        raise ApiError(400, f"status must be one of {', '.join(JOB_STATUSES)}", param="status")
    jobs, has_more = lifecycle.list_jobs(
        settings(), current_tenant(), status=status, limit=limit_param(), after=request.args.get("after")
    )
    return jsonify(list_body([_job_json(job) for job in jobs], has_more))


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str):
    return jsonify(cached_job_body("job", current_tenant(), job_id, job_object))


@bp.post("/v1/jobs/<job_id>/cancel")
def cancel_job(job_id: str):
    return jsonify(_job_json(lifecycle.cancel_job(settings(), current_tenant(), job_id)))


@bp.get("/v1/jobs/<job_id>/results")
def get_results(job_id: str):
    """Parquet by default; ?format=jsonl for OpenAI-style output lines."""
    job = lifecycle.get_job(settings(), current_tenant(), job_id)
    fmt = request.args.get("format", "parquet")
    if fmt not in ("parquet", "jsonl"):
        raise ApiError(400, "format must be parquet or jsonl", param="format")
    if job.status not in TERMINAL_STATUSES:
        raise ApiError(
            409, f"job {job_id} is {job.status}; results are ready when it finishes", code="not_ready"
        )
    if fmt == "parquet":
        store = lifecycle.results_store(settings())
        return send_fs(
            store.fs, store.merged_path(job.id), "application/vnd.apache.parquet", f"{job.id}.parquet"
        )
    if job.output_file_id is None:
        return send_lines(iter(()), f"{job.id}_output.jsonl")
    return send_stored(lifecycle.output_key(job.id), "application/x-ndjson", f"{job.id}_output.jsonl")


@bp.get("/v1/jobs/<job_id>/errors")
def get_errors(job_id: str):
    """OpenAI-style error lines: the invalid lines at once, and the failed requests so far."""
    job = lifecycle.get_job(settings(), current_tenant(), job_id)
    if job.status in TERMINAL_STATUSES and job.error_file_id:
        return send_stored(lifecycle.errors_key(job.id), "application/x-ndjson", f"{job.id}_errors.jsonl")
    return send_lines(lifecycle.results_store(settings()).iter_error_jsonl(job.id), f"{job.id}_errors.jsonl")
