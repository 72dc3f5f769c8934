"""OpenAI's Uploads API: /v1/uploads, its parts, complete and cancel (store.filestore.uploads does the work)."""

from __future__ import annotations

from flask import Blueprint, request

from api.auth import current_tenant
from api.errors import ApiError
from api.inputs import BatchListQuery
from api.objects_uploads import Upload, UploadComplete, UploadCreate, UploadList, UploadPart
from api.platform import settings
from api.routes.params import json_body, query, reject_nul_bytes
from api.routes.responses import send_object
from api.routes.uploads import check_content_length, upload_chunks
from api.serializers import file_object, page, ts
from store.filestore import uploads

bp = Blueprint("openai_uploads", __name__)
bp.before_request(reject_nul_bytes)

COMPLETE_BODY = 1 << 20  # room for 10,000 part ids


def _upload(record, file=None) -> Upload:
    return Upload(
        id=record.id, bytes=record.bytes, created_at=ts(record.created_at), expires_at=ts(record.expires_at),
        filename=record.filename, purpose=record.purpose, status=record.status,
        file=file_object(file) if file is not None else None,
    )  # fmt: skip


@bp.post("/v1/uploads")
def create_upload():
    body = json_body(UploadCreate)
    record = uploads.create_upload(
        settings(), tenant=current_tenant(), filename=body.filename, purpose=body.purpose, size=body.bytes,
        mime_type=body.mime_type,
    )  # fmt: skip
    return send_object(_upload(record))


@bp.get("/v1/uploads")
def list_uploads():
    params = query(BatchListQuery)
    pairs, more = uploads.list_uploads(settings(), current_tenant(), limit=params.limit, after=params.after)
    return send_object(page(UploadList, [_upload(record, file) for record, file in pairs], more))


@bp.post("/v1/uploads/<upload_id>/parts")
def add_part(upload_id: str):
    """One part as the multipart field `data`, spooled to disk past 512 KiB while it is parsed, then streamed
    into the storage."""
    check_content_length()
    uploads.get_upload(settings(), current_tenant(), upload_id)  # a 404 before the body is read
    data = request.files.get("data")
    if data is None:
        raise ApiError(400, "missing multipart field 'data'", param="data")
    part = uploads.add_part(settings(), current_tenant(), upload_id, upload_chunks(data.stream))
    return send_object(UploadPart(id=part.id, created_at=ts(part.created_at), upload_id=upload_id))


@bp.post("/v1/uploads/<upload_id>/complete")
def complete_upload(upload_id: str):
    body = json_body(UploadComplete, COMPLETE_BODY)
    record, file = uploads.complete_upload(settings(), current_tenant(), upload_id, body.part_ids, body.md5)
    return send_object(_upload(record, file))


@bp.post("/v1/uploads/<upload_id>/cancel")
def cancel_upload(upload_id: str):
    return send_object(_upload(uploads.cancel_upload(settings(), current_tenant(), upload_id)))
