"""The API's objects as pydantic models: the one definition behind both the JSON the routes send
(api.serializers) and the OpenAPI document's `components.schemas` (api.spec.openapi).

OpenAI's objects (File, Batch, ErrorResponse) follow the official `openai` client's types, field
for field; Job is the native object. Every field is always sent, so every field is required in the
document (nullable where it may be null), and no object carries properties it does not declare.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from store.models import JOB_STATUSES, MAX_PRIORITY, MIN_PRIORITY

BATCH_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/v1/rerank",
)
COMPLETION_WINDOWS = ("24h",)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's metadata limits

JobStatus = Literal[JOB_STATUSES]  # OpenAI's batch statuses
INTEGRAL = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)
"""3.0 taken as 3 (JSON Schema's integer; strict validation otherwise refuses a float): put it after the bounds"""
Integer = Annotated[int, INTEGRAL]
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold a NUL: every string the API stores or looks up is free of it
ID_CHARS = 128
Text = Annotated[str, StringConstraints(pattern=NO_NUL)]
IdRef = Annotated[str, StringConstraints(min_length=1, max_length=ID_CHARS, pattern=NO_NUL)]
"""An object's id where one is given (a body field, a cursor): an unknown one is a 404"""
PathId = Annotated[str, StringConstraints(min_length=1, max_length=ID_CHARS, pattern=r"^[^\x00/]+$")]
"""An object's id in a path: one segment"""
Timestamp = Annotated[int | None, Field(description="Unix seconds")]
MetadataPairs = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=METADATA_KEY_CHARS, pattern=NO_NUL)],
        Annotated[str, StringConstraints(max_length=METADATA_VALUE_CHARS, pattern=NO_NUL)],
    ],
    Field(max_length=METADATA_PAIRS, description="Up to 16 string pairs (OpenAI's metadata)"),
]
Metadata = Annotated[MetadataPairs | None, Field(description="Up to 16 string pairs (OpenAI's metadata)")]


class ApiObject(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_serialization_defaults_required=True, use_attribute_docstrings=True
    )


class Error(ApiObject):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ApiObject):
    """Every error the API answers: OpenAI's {"error": {...}}."""

    error: Error


class LineError(ApiObject):
    """An input line that failed validation (OpenAI's BatchError)."""

    code: str
    message: str
    param: str | None
    line: int | None


class File(ApiObject):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds")
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: Timestamp = None
    status_details: str | None = None


class FileDeleted(ApiObject):
    """The answer to DELETE /v1/files/{file_id} (OpenAI's FileDeleted)."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchErrors(ApiObject):
    object: Literal["list"] = "list"
    data: list[LineError]


class BatchRequestCounts(ApiObject):
    total: int
    completed: int
    failed: int
    """Requests that failed running, and input lines that failed validation"""


class InputTokensDetails(ApiObject):
    cached_tokens: int = 0


class OutputTokensDetails(ApiObject):
    reasoning_tokens: int = 0


class BatchUsage(ApiObject):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class Batch(ApiObject):
    """OpenAI's Batch: a job seen through the OpenAI Batch API."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: JobStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int = Field(description="Unix seconds")
    in_progress_at: Timestamp
    expires_at: Timestamp
    finalizing_at: Timestamp
    completed_at: Timestamp
    failed_at: Timestamp
    expired_at: Timestamp
    cancelling_at: Timestamp
    cancelled_at: Timestamp
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: Metadata


class JobRequestCounts(ApiObject):
    total: int
    """Every input line"""
    valid: int
    invalid: int
    """Lines that failed validation"""
    completed: int
    failed: int
    """Valid requests that failed running"""
    cancelled: int


class PromptTokensDetails(ApiObject):
    cached_tokens: int = 0
    """Prompt tokens read from the prefix cache"""


class JobUsage(ApiObject):
    prompt_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens: int
    total_tokens: int


class JobPlan(ApiObject):
    """The validation's prefix plan: lines sharing a prompt prefix grouped so each worker computes it once"""

    prompt_tokens: int
    """Prompt tokens of the valid lines"""
    expected_cached_tokens: int
    """Of those, the ones the plan expects the prefix cache to serve"""
    max_completion_tokens: int
    """The most completion tokens the lines may generate"""
    cached_tokens: int
    """Prompt tokens actually served from the prefix cache so far (usage.prompt_tokens_details.cached_tokens)"""


class JobQuote(ApiObject):
    """A file planned and priced without running it (POST /v1/jobs?dry_run=true, `pagedbatch quote`)"""

    object: Literal["job.quote"] = "job.quote"
    model: str
    lines: int
    """Valid lines"""
    invalid_lines: int
    shards: int
    prompt_tokens: int
    expected_cached_tokens: int
    """Prompt tokens the prefix plan expects the cache to serve"""
    max_completion_tokens: int
    workers: int
    """Workers serving the model now"""
    estimated_run_seconds: float | None
    """From the workers' measured step rates; null until a worker of the model has run"""
    queue_ahead_seconds: float | None
    """The work of the model's running and validating jobs"""
    estimated_start_at: Timestamp
    estimated_completion_at: Timestamp


class Job(ApiObject):
    """The native job: status, request counts, token usage, progress and timestamps."""

    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str | None
    endpoint: str | None
    defaults: dict[str, Any] | None
    """Body fields every line gets unless it sets them"""
    metadata: Metadata
    priority: int = Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)
    """vLLM's meaning: a lower value is served first, among its tenant's jobs (tenants share by weight)"""
    input_file_id: str | None
    output_file_id: str | None
    error_file_id: str | None
    request_counts: JobRequestCounts
    usage: JobUsage
    progress: float = Field(ge=0, le=1)
    """Fraction of valid requests whose shard has finished"""
    shards: int
    plan: JobPlan
    estimated_completion_at: Timestamp
    """While it runs: now plus the requests left at the rate it has finished them so far; null before its first"""
    deadline_at_risk: bool = False
    """The estimate passes the end of its completion_window (expires_at): flagged while there is time to act"""
    errors: list[LineError]
    """The first line errors"""
    status_detail: str | None
    """Why the job waits, while it does (e.g. "storage_full: finalizing will retry"); null once it moves on"""
    created_at: int = Field(description="Unix seconds")
    in_progress_at: Timestamp
    expires_at: Timestamp
    finalizing_at: Timestamp
    completed_at: Timestamp
    failed_at: Timestamp
    expired_at: Timestamp
    cancelling_at: Timestamp
    cancelled_at: Timestamp


Item = TypeVar("Item", bound=ApiObject)


class ListOf(ApiObject, Generic[Item]):
    """A page of objects, newest first; `after=last_id` asks for the next page."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileList(ListOf[File]):
    pass


class BatchList(ListOf[Batch]):
    pass


class JobList(ListOf[Job]):
    pass


class Model(ApiObject):
    """A model this deployment serves (OpenAI's Model)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "pagedbatch"
    root: str | None = None  # vLLM's: the model's directory (a LoRA adapter's: the adapter's)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model (lines naming the adapter run on it)


class ModelList(ApiObject):
    object: Literal["list"] = "list"
    data: list[Model]


class ExpiresAfter(ApiObject):
    """OpenAI's expiration policy: the file is gone `seconds` (an hour to 30 days) after it is created."""

    anchor: Literal["created_at"]
    seconds: Integer = Field(ge=3600, le=2_592_000)


class BatchCreate(ApiObject):
    """The body of POST /v1/batches (OpenAI's batch create parameters)."""

    model_config = ConfigDict(extra="allow")  # OpenAI's other parameters are ignored

    input_file_id: IdRef
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Literal[COMPLETION_WINDOWS]
    metadata: Metadata = None
    output_expires_after: ExpiresAfter | None = None
    on_invalid_lines: Literal["fail", "skip"] = Field(
        "fail",
        description="pagedbatch's option: `fail` (OpenAI's behaviour) fails a file with any invalid line at "
        "validation; `skip` runs the valid lines and reports the others in the error file",
    )
    priority: Integer = Field(
        0,
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description="pagedbatch's option (the `openai` client sends it with `extra_body`): vLLM's meaning, a lower "
        "value is served first among the tenant's batches; across tenants their weights rule. Shown by "
        "GET /v1/jobs/{id}, not in the Batch object",
    )


RESPONSE_OBJECTS: tuple[type[ApiObject], ...] = (
    ErrorResponse,
    File,
    FileDeleted,
    Batch,
    Job,
    JobQuote,
    FileList,
    BatchList,
    JobList,
    ModelList,
)
REQUEST_OBJECTS: tuple[type[ApiObject], ...] = (BatchCreate,)
