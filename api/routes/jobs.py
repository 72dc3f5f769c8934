"""The native API: /v1/jobs."""

from __future__ import annotations

import tempfile

from flask import Blueprint, jsonify, request

from api.auth import current_tenant
from api.errors import ApiError
from api.inputs import JobListQuery, JobOptions, JobUpload, ResultsQuery
from api.objects import JobList, JobQuote
from api.objects_uploads import ResultLines
from api.platform import settings, validate_in_background
from api.routes.params import declared, priority_param, query, reject_nul_bytes
from api.routes.responses import cached_job_body, send_fs, send_lines, send_object, send_stored
from api.routes.uploads import check_content_length, upload_chunks, upload_filename
from api.serializers import job_object, page, quote_object
from store.filestore import files
from store.filestore.paths import errors_key, output_key
from store.lifecycle import cancel, jobs
from store.lifecycle.progress import job_progress
from store.lifecycle.quotes import quote_file
from store.lifecycle.validating import model_limits
from store.models import TERMINAL_STATUSES
from store.results.live import lines_after
from store.results.parts import results_store

bp = Blueprint("jobs", __name__)
bp.before_request(reject_nul_bytes)

QUOTE_SPOOL_IN_MEMORY = 8 * 1024 * 1024  # a quoted file above this waits on disk while it is planned
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/json-lines", "text/plain")


def _job(job):
    return job_object(job, job_progress(settings(), job))


@bp.post("/v1/jobs")
def create_job():
    """A JSONL upload (multipart field `file`, or a raw application/x-ndjson body) becomes a job."""
    check_content_length()
    cfg = settings()
    tenant = current_tenant()
    files.check_upload_allowed(cfg, tenant, for_job=True)  # before the body is read
    if request.mimetype == "multipart/form-data":
        upload = request.files.get("file")
        if upload is None:
            raise ApiError(400, "missing multipart field 'file'", param="file")
        fields = request.form
        # a misspelt option would otherwise be dropped without a word (the document closes the form); the /ui form
        # calls this view too, with its CSRF field
        unknown = sorted((set(fields) | set(request.files)) - set(JobUpload.model_fields))
        if unknown and request.path == "/v1/jobs":
            raise ApiError(
                400, f"unknown multipart fields: {unknown}; this form takes {sorted(JobUpload.model_fields)}"
            )
        chunks, filename = upload_chunks(upload.stream), upload_filename(upload)
    elif request.mimetype in NDJSON_TYPES:
        fields = request.args
        chunks, filename = upload_chunks(request.stream), "input.jsonl"
    else:
        raise ApiError(415, "send the JSONL as multipart/form-data (field 'file') or as application/x-ndjson")
    for source in (request.args, fields):
        priority_param(source.get("priority"))  # its own message: what the value means
    # a multipart body's options are its form fields; query parameters (a raw body's) are checked all the same
    query_options = declared(JobOptions, request.args)
    options = declared(JobOptions, fields) if fields is not request.args else query_options
    if "model" not in options:
        raise ApiError(400, "model is required", param="model")
    if options.get("dry_run") == "true":
        return send_object(_quote(cfg, chunks, options))
    input_file = files.store_upload(cfg, chunks, tenant=tenant, filename=filename, purpose="batch", for_job=True)
    job, owner = jobs.create_job(
        cfg,
        input_file,
        tenant=tenant,
        model=options["model"],
        defaults=options.get("defaults"),
        metadata=options.get("metadata"),
        on_invalid_lines=options.get("on_invalid_lines", "skip"),  # the native API runs the valid lines
        priority=options.get("priority", 0),
    )
    validate_in_background(job.id, owner)
    return send_object(_job(job), 201)


def _quote(cfg, chunks, options) -> JobQuote:
    """The file validated and planned in a temporary spool, priced, then forgotten."""
    model = options["model"]
    with tempfile.SpooledTemporaryFile(max_size=QUOTE_SPOOL_IN_MEMORY) as spool:
        size = 0
        for chunk in chunks:
            size += len(chunk)
            if size > cfg.max_upload_bytes:
                raise ApiError(413, f"the file is larger than {cfg.max_upload_bytes} bytes")
            spool.write(chunk)
        spool.seek(0)
        found = quote_file(
            cfg,
            spool,
            model_limits(cfg, model),  # an unknown model: a 400
            model,
            endpoint=None,
            defaults=options.get("defaults"),
            bounds=cfg.request_bounds(openai=False),
        )
    return quote_object(model, found)


@bp.get("/v1/jobs")
def list_jobs():
    params = query(JobListQuery)
    found, has_more = jobs.list_jobs(
        settings(), current_tenant(), status=params.status, limit=params.limit, after=params.after
    )
    return send_object(page(JobList, [_job(job) for job in found], has_more))


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str):
    return jsonify(cached_job_body("job", current_tenant(), job_id, job_object))


@bp.post("/v1/jobs/<job_id>/cancel")
def cancel_job(job_id: str):
    return send_object(_job(cancel.cancel_job(settings(), current_tenant(), job_id)))


@bp.get("/v1/jobs/<job_id>/results")
def get_results(job_id: str):
    """Parquet by default; ?format=jsonl for OpenAI-style output lines; ?after=CURSOR for the lines completed so
    far, running or not (a JSON page with the next cursor)."""
    params = query(ResultsQuery)
    fmt = params.format
    job = jobs.get_job(settings(), current_tenant(), job_id)
    if params.after is not None:
        lines, cursor, more = lines_after(settings(), job.id, params.after, params.limit)
        return send_object(ResultLines(data=lines, next_cursor=cursor, has_more=more, job_status=job.status))
    if job.status not in TERMINAL_STATUSES:
        raise ApiError(409, f"job {job_id} is {job.status}; results are ready when it finishes", code="not_ready")
    if fmt == "parquet":
        store = results_store(settings())
        return send_fs(store.fs, store.merged_path(job.id), "application/vnd.apache.parquet", f"{job.id}.parquet")
    if job.output_file_id is None:
        return send_lines(iter(()), f"{job.id}_output.jsonl")
    return send_stored(output_key(job.id), "application/x-ndjson", f"{job.id}_output.jsonl")


@bp.get("/v1/jobs/<job_id>/errors")
def get_errors(job_id: str):
    """OpenAI-style error lines: the invalid lines at once, and the failed requests so far."""
    job = jobs.get_job(settings(), current_tenant(), job_id)
    if job.status in TERMINAL_STATUSES and job.error_file_id:
        return send_stored(errors_key(job.id), "application/x-ndjson", f"{job.id}_errors.jsonl")
    return send_lines(results_store(settings()).iter_error_jsonl(job.id), f"{job.id}_errors.jsonl")
