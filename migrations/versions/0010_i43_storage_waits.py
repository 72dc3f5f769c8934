"""jobs waiting on storage: jobs.status_detail, storage_failures, storage_failing_since, retry_at; shards.retry_at

Revision ID: 0010_i43
Revises: 0009_i36
Create Date: 2026-12-05 19:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_i43"
down_revision: str | None = "0009_i36"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("status_detail", sa.String(512), nullable=True))
    op.add_column("jobs", sa.Column("storage_failures", sa.Integer(), server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("storage_failing_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("shards", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("shards", "retry_at")
    for column in ("retry_at", "storage_failing_since", "storage_failures", "status_detail"):
        op.drop_column("jobs", column)
