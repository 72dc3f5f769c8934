"""API objects of uploads in parts (OpenAI's Upload and UploadPart, field for field, and the bodies of
POST /v1/uploads and /complete) and of results read while a job runs (a page of lines and the next cursor)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints

from api.objects import ApiObject, File, IdRef, Integer, JobStatus, ListOf
from store.filestore.uploads import BATCH_MIME_TYPES


class Upload(ApiObject):
    """OpenAI's Upload: a file that arrives in parts."""

    id: str
    object: Literal["upload"] = "upload"
    bytes: int
    """The intended number of bytes"""
    created_at: int = Field(description="Unix seconds")
    expires_at: int = Field(description="Unix seconds: a pending upload expires then")
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: File | None
    """The file made by completing the upload"""


class UploadPart(ApiObject):
    """OpenAI's UploadPart."""

    id: str
    object: Literal["upload.part"] = "upload.part"
    created_at: int = Field(description="Unix seconds")
    upload_id: str


class UploadList(ListOf[Upload]):
    """pagedbatch's list of the tenant's uploads (to find a pending one to resume)."""


class UploadCreate(ApiObject):
    """The body of POST /v1/uploads (OpenAI's upload create parameters)."""

    model_config = ConfigDict(extra="allow")  # OpenAI's other parameters (expires_after) are ignored

    bytes: Integer = Field(ge=1, description="The whole file's bytes (at most the deployment's upload limit)")
    filename: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^[^\x00]*$")]
    mime_type: Literal[BATCH_MIME_TYPES]
    purpose: Literal["batch"]


class UploadComplete(ApiObject):
    """The body of POST /v1/uploads/{upload_id}/complete."""

    model_config = ConfigDict(extra="allow")

    part_ids: list[IdRef] = Field(
        min_length=1, max_length=10_000, description="The parts, in file order, each once",
        json_schema_extra={"uniqueItems": True},
    )  # fmt: skip
    md5: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$")] = Field(  # OpenAI's: a string or absent
        None, description="The whole file's md5 (hex): the upload fails, and no file is made, if it differs"
    )


class ResultLines(ApiObject):
    """Completed lines of a job, running or not, in the order they completed, after a cursor."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    """OpenAI batch output lines (`error` set for a request that failed running)"""
    next_cursor: str
    """Give it as `after` for the lines that complete next (the same cursor when none did yet)"""
    has_more: bool
    """More lines are ready now (the page was full)"""
    job_status: JobStatus


UPLOAD_RESPONSES = (Upload, UploadPart, UploadList, ResultLines)
UPLOAD_REQUESTS = (UploadCreate, UploadComplete)
