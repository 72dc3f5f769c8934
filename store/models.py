"""SQLAlchemy models of the job store. The schema is changed only through migrations/."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import JSON, BigInteger, CheckConstraint, DateTime, Float, ForeignKey, Index, Integer, String, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


# OpenAI's batch status names, used by both API faces.
VALIDATING, FAILED, IN_PROGRESS, FINALIZING = "validating", "failed", "in_progress", "finalizing"
COMPLETED, EXPIRED, CANCELLING, CANCELLED = "completed", "expired", "cancelling", "cancelled"
JOB_STATUSES = (VALIDATING, FAILED, IN_PROGRESS, FINALIZING, COMPLETED, EXPIRED, CANCELLING, CANCELLED)
TERMINAL_STATUSES = (FAILED, COMPLETED, EXPIRED, CANCELLED)
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # count against a tenant's limit

# Shard states.
SHARD_QUEUED, SHARD_RUNNING, SHARD_DONE, SHARD_CANCELLED = "queued", "running", "done", "cancelled"
SHARD_HELD = "held"  # validated, waiting for the whole file to pass (on_invalid_lines=fail)

# What a job does with lines that fail validation: fail the whole job (OpenAI's /v1/batches) or run
# the valid lines and report the others (the native /v1/jobs).
FAIL_INVALID, SKIP_INVALID = "fail", "skip"
INVALID_LINE_POLICIES = (FAIL_INVALID, SKIP_INVALID)

# A job's priority (vLLM's meaning: a lower value is served first) orders its tenant's requests in a worker.
MIN_PRIORITY, MAX_PRIORITY = -100, 100


class File(Base):
    """An uploaded input file or a produced output/error file, stored under `storage_key`."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True, default="default")
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output | batch_errors
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    line_count: Mapped[int | None] = mapped_column(Integer, nullable=True)
    storage_key: Mapped[str] = mapped_column(String(1024))
    content_type: Mapped[str] = mapped_column(String(64), default="application/jsonl")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Deleted files keep their row (jobs refer to them) but lose their content and vanish from reads.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index("ix_files_tenant_created", "tenant", "created_at", "id"),)


class Job(Base):
    """One batch job (an OpenAI batch): its status, counts and timestamps."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default="default")
    status: Mapped[str] = mapped_column(String(16), default=VALIDATING)
    endpoint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    defaults: Mapped[dict | None] = mapped_column(JSONType, nullable=True)
    job_metadata: Mapped[dict | None] = mapped_column("metadata", JSONType, nullable=True)
    completion_window: Mapped[str] = mapped_column(String(16), default="24h")
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # lower first, in its tenant
    # OpenAI's output_expires_after: the output and error files expire this long after their creation
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    input_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), nullable=True)
    # Counts. `request_total` is every input line; `invalid_lines` failed validation. The completed and
    # failed counts and token usage are set from the durably written parts, never incremented.
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    invalid_lines: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)  # includes the invalid lines
    request_cancelled: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # of prompt_tokens, prefix-cache hits
    # The validation's prefix plan (batchfile.prefix_plan): the valid lines' prompt tokens, those the plan expects
    # the prefix cache to serve, and the most completion tokens the lines may generate.
    planned_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    planned_cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    planned_completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    shard_count: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[list | None] = mapped_column(JSONType, nullable=True)  # the first validation errors
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Validation runs in the background (store.lifecycle.validating), resumable: `validated_lines` input lines are
    # committed (their shards and `validation_parts` error parts written); `validation_owner` renews
    # `validation_heartbeat_at` while it works, and a silent one is replaced; `validated_at` marks the end.
    on_invalid_lines: Mapped[str | None] = mapped_column(String(8), nullable=True)
    served_model: Mapped[str | None] = mapped_column(String(256), nullable=True)  # the first valid line's
    validated_lines: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    validation_parts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    validation_owner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    validation_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    validated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # A claimant (validator, shard writer, finalizer) that failed gave its claim back: why the job waits
    # (`status_detail`, e.g. "storage_full: finalizing will retry"), since when, and when it is tried again.
    status_detail: Mapped[str | None] = mapped_column(String(512), nullable=True)
    storage_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    storage_failing_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # When its end (completed, failed, cancelled, expired) was turned into webhook deliveries: null until then.
    announced_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        Index("ix_jobs_tenant_created", "tenant", "created_at", "id"),
        Index("ix_jobs_tenant_status", "tenant", "status"),
        Index("ix_jobs_unannounced", "status", postgresql_where=text("announced_at IS NULL")),
        CheckConstraint(f"priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY}", name="ck_jobs_priority"),
    )


class Shard(Base):
    """A slice of a job's valid requests (one model), run by one worker task, written as one part."""

    __tablename__ = "shards"

    id: Mapped[str] = mapped_column(String(96), primary_key=True)  # "<job id>.<index>"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default=SHARD_QUEUED)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    request_count: Mapped[int] = mapped_column(Integer, default=0)
    input_key: Mapped[str] = mapped_column(String(1024))
    part_key: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    worker: Mapped[str | None] = mapped_column(String(256), nullable=True)
    # Set (not incremented) from the shard's written part, so a redelivered shard counts once.
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # of prompt_tokens, prefix-cache hits
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Running: the claiming worker renews this while it works (a heartbeat); once it passes, the shard is
    # handed to another worker. Queued: when the sweeper next checks that its broker message still exists.
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Queued after its writer failed on the storage: not run before this (the sweeper sends it then).
    retry_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        Index("ix_shards_job_status", "job_id", "status"),
        Index("ix_shards_status_lease", "status", "lease_until"),
    )


class Tenant(Base):
    """A tenant: the owner of jobs, files and keys, with optional limits overriding the settings."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    max_active_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued_requests: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_files: Mapped[int | None] = mapped_column(Integer, nullable=True)  # uploaded files kept at once
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # their bytes together
    # Its share of a worker's engine beside other tenants' (workers.host.fair_share): twice the weight, twice the share.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (CheckConstraint("weight > 0", name="ck_tenants_weight"),)


class ApiKey(Base):
    """An API key of a tenant, stored only as the sha256 of the key; `prefix` identifies it in lists."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class WorkerModel(Base):
    """A running worker and the model it serves, registered at start and kept fresh by its heartbeats
    (`store.models_registry`): the API lists and validates against the models whose heartbeat is recent."""

    __tablename__ = "worker_models"

    worker: Mapped[str] = mapped_column(String(256), primary_key=True)  # "<model>-<pid>@<host>"
    model: Mapped[str] = mapped_column(String(256), index=True)
    path: Mapped[str] = mapped_column(String(1024))  # the model directory, as the worker sees it
    endpoints: Mapped[list] = mapped_column(JSONType)
    max_model_len: Mapped[int] = mapped_column(Integer)
    hostname: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int] = mapped_column(Integer)
    metrics_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    adapters: Mapped[dict | None] = mapped_column(JSONType, nullable=True)  # LoRA adapters: {name: directory}
    # measured at its heartbeats (workers.throughput): engine busy seconds and the tokens computed in them
    throughput: Mapped[dict | None] = mapped_column(JSONType, nullable=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


# An upload's states (OpenAI's Upload.status).
UPLOAD_PENDING, UPLOAD_COMPLETED, UPLOAD_CANCELLED, UPLOAD_EXPIRED = "pending", "completed", "cancelled", "expired"


class Upload(Base):
    """A file uploaded in parts (OpenAI's Uploads API): its parts are stored as they come and joined, in the
    order `complete` names them, into a normal input file (`file_id`)."""

    __tablename__ = "uploads"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    mime_type: Mapped[str] = mapped_column(String(128))
    bytes: Mapped[int] = mapped_column(BigInteger)  # what the whole file will hold, declared at creation
    status: Mapped[str] = mapped_column(String(16), default=UPLOAD_PENDING)
    file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_uploads_status_expires", "status", "expires_at"),)


class UploadPart(Base):
    """One part of an upload, stored under `storage_key` until the upload completes or goes."""

    __tablename__ = "upload_parts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    storage_key: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEndpoint(Base):
    """Where a tenant's events are sent (OpenAI's webhook endpoint), signed with `secret` (whsec_...); after a
    rotation that keeps the old secret, deliveries are signed with both until `previous_secret_until`."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(256))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list] = mapped_column(JSONType)
    secret: Mapped[str] = mapped_column(String(128))
    previous_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    previous_secret_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant", "created_at", "id"),)


# A delivery's states: sent until the endpoint answers 2xx (delivered) or the attempts run out (failed).
DELIVERY_PENDING, DELIVERY_DELIVERED, DELIVERY_FAILED = "pending", "delivered", "failed"


class WebhookDelivery(Base):
    """One event for one endpoint: its exact body (what is signed), and each attempt's outcome (the log)."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant: Mapped[str] = mapped_column(String(64))
    event_id: Mapped[str] = mapped_column(String(64))  # the webhook-id header: the same on every attempt
    event_type: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(String)
    status: Mapped[str] = mapped_column(String(16), default=DELIVERY_PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(512), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "created_at", "id"),
    )
