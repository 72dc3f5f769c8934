"""What the API accepts besides JSON bodies: the query parameters and multipart forms, as pydantic models.
The handlers validate with them (api.routes.params) and the OpenAPI document publishes them (api.spec.openapi),
so a published constraint is an enforced one. JSON bodies are declared in api.objects (BatchCreate)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypeAliasType

from api.objects import INTEGRAL, NO_NUL, ExpiresAfter, IdRef, Integer, JobStatus, MetadataPairs, Text
from store.models import INVALID_LINE_POLICIES, MAX_PRIORITY, MIN_PRIORITY

JsonValue = TypeAliasType(
    "JsonValue",
    Union[  # noqa: UP007 - a recursive alias needs Union's subscript form
        None,
        bool,
        int,
        Annotated[float, Field(allow_inf_nan=False)],
        Text,
        list["JsonValue"],
        dict[Text, "JsonValue"],
    ],
)
"""Any JSON value without a NUL in its strings or keys (PostgreSQL's jsonb holds none)"""

_JSON_VALUE = {"$ref": "#/components/schemas/JsonValue"}
JSON_VALUE_SCHEMA = {
    "description": "Any JSON value without a NUL in its strings or keys",
    "type": ["null", "boolean", "number", "string", "array", "object"],
    "pattern": NO_NUL,
    "items": _JSON_VALUE,
    "propertyNames": {"pattern": NO_NUL},
    "additionalProperties": _JSON_VALUE,
}
"""JsonValue as the document states it: pydantic's anyOf of one schema per type, as one schema. The same
values, and no "another type" a fuzzer could mutate a value into that is still valid."""
Priority = Annotated[
    int,
    Field(
        ge=MIN_PRIORITY, le=MAX_PRIORITY, description="lower is served first, among the tenant's jobs (vLLM's meaning)"
    ),
    INTEGRAL,
]
LIMIT = "How many objects a page holds"
AFTER = "Cursor: the id of the last object of the previous page"
JSON_PARTS = frozenset({"defaults", "metadata", "expires_after"})
"""Fields whose form part or query parameter carries JSON text"""


class Inputs(BaseModel):
    """Parameters the API reads: unknown ones are ignored (OpenAI's clients send extra ones)."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class JobListQuery(Inputs):
    status: JobStatus = None
    limit: Integer = Field(20, ge=1, le=100, description=LIMIT)
    after: IdRef = Field(None, description=AFTER)


class BatchListQuery(Inputs):
    limit: Integer = Field(20, ge=1, le=100, description=LIMIT)
    after: IdRef = Field(None, description=AFTER)


class FileListQuery(Inputs):
    purpose: Text = None
    limit: Integer = Field(10_000, ge=1, le=10_000, description=LIMIT)  # OpenAI's default and maximum
    after: IdRef = Field(None, description=AFTER)
    order: Literal["asc", "desc"] = Field("desc", description="By created_at")


class ResultsQuery(Inputs):
    format: Literal["parquet", "jsonl"] = "parquet"
    after: Annotated[str, Field(max_length=3_800, pattern=r"^[A-Za-z0-9_-]*$")] = Field(
        None,
        description="Read the lines completed so far, running or not, as a JSON page (ResultLines): `0` for the "
        "first page, then the page's `next_cursor`. Lines come in the order their shards finished, each exactly "
        "once; `format` is then ignored",
    )
    limit: Integer = Field(100, ge=1, le=1000, description="With `after`: the most lines a page holds")


class FileUpload(Inputs):
    """POST /v1/files (OpenAI): `expires_after` is a JSON part, or OpenAI's form fields
    `expires_after[anchor]` and `expires_after[seconds]`."""

    file: bytes = Field(description="JSONL, one OpenAI batch request a line")
    purpose: Literal["batch"]
    expires_after: ExpiresAfter = None


class JobOptions(Inputs):
    """The job's options, as form fields beside the file or as query parameters beside a raw body."""

    model: Annotated[str, Field(min_length=1, pattern=NO_NUL)]
    """The model serving every line (one of those this deployment serves)"""
    defaults: dict[Text, JsonValue] = None
    """Body fields every line gets unless it sets them (JSON)"""
    metadata: MetadataPairs = None
    on_invalid_lines: Literal[INVALID_LINE_POLICIES] = "skip"
    """skip: run the valid lines and report the others; fail: the job fails when a line is invalid"""
    priority: Priority = 0
    dry_run: Literal["true", "false"] = "false"
    """true: validate, plan and quote the file (a job.quote), create nothing and run nothing"""


class JobUpload(JobOptions):
    """POST /v1/jobs as multipart: the JSONL and the job's options."""

    file: bytes = Field(description="JSONL, one OpenAI batch request a line")
