"""uploads in parts (uploads, upload_parts), webhooks (webhook_endpoints, webhook_deliveries), jobs.announced_at

Revision ID: 0012_i35a
Revises: 0011_i32l
Create Date: 2026-12-06 03:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012_i35a"
down_revision: str | None = "0011_i32l"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _when(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("mime_type", sa.String(128), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("file_id", sa.String(64), sa.ForeignKey("files.id"), nullable=True),
        _when("created_at", False),
        _when("expires_at", False),
    )
    op.create_index("ix_uploads_status_expires", "uploads", ["status", "expires_at"])
    op.create_table(
        "upload_parts",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "upload_id", sa.String(64), sa.ForeignKey("uploads.id", ondelete="CASCADE"), nullable=False, index=True
        ),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_key", sa.String(1024), nullable=False),
        _when("created_at", False),
    )
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False, index=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("event_types", JSON, nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("previous_secret", sa.String(128), nullable=True),
        _when("previous_secret_until"),
        _when("created_at", False),
        _when("updated_at", False),
        _when("deleted_at"),
    )
    op.create_index("ix_webhook_endpoints_tenant_created", "webhook_endpoints", ["tenant", "created_at", "id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(
            "endpoint_id", sa.String(64), sa.ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("event_type", sa.String(64), nullable=False),
        sa.Column("body", sa.String(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _when("next_attempt_at"),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(512), nullable=True),
        _when("created_at", False),
        _when("delivered_at"),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_index("ix_webhook_deliveries_endpoint", "webhook_deliveries", ["endpoint_id", "created_at", "id"])
    op.add_column("jobs", _when("announced_at"))
    # jobs that ended before webhooks existed are not announced now
    op.execute("UPDATE jobs SET announced_at = now() WHERE status IN ('completed', 'failed', 'cancelled', 'expired')")
    op.create_index("ix_jobs_unannounced", "jobs", ["status"], postgresql_where=sa.text("announced_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_jobs_unannounced", table_name="jobs")
    op.drop_column("jobs", "announced_at")
    for table in ("webhook_deliveries", "webhook_endpoints", "upload_parts", "uploads"):
        op.drop_table(table)
