"""batch parity: validation in the background (resumable), the invalid-lines policy

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 05:15:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("served_model", sa.String(256), nullable=True))
    op.add_column("jobs", sa.Column("on_invalid_lines", sa.String(8), nullable=True))
    op.add_column("jobs", sa.Column("validated_lines", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("validation_parts", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("validation_owner", sa.String(64), nullable=True))
    op.add_column("jobs", sa.Column("validation_heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("validated_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE jobs SET validated_at = created_at, on_invalid_lines = 'skip' WHERE status <> 'validating'")


def downgrade() -> None:
    for column in (
        "validated_at",
        "validation_heartbeat_at",
        "validation_owner",
        "validation_parts",
        "validated_lines",
        "on_invalid_lines",
        "served_model",
    ):
        op.drop_column("jobs", column)
