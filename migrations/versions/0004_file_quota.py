"""file quota and deletion: per-tenant file limits, soft-deleted files, file expiry, batch output expiry

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 02:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_files", sa.Integer(), nullable=True))
    op.add_column("tenants", sa.Column("max_file_bytes", sa.BigInteger(), nullable=True))
    op.add_column("files", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("output_expires_after_s", sa.Integer(), nullable=True))
    op.create_index("ix_files_tenant_created", "files", ["tenant", "created_at", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_files_tenant_created", table_name="files")
    op.drop_column("jobs", "output_expires_after_s")
    op.drop_column("files", "expires_at")
    op.drop_column("files", "deleted_at")
    op.drop_column("tenants", "max_file_bytes")
    op.drop_column("tenants", "max_files")
