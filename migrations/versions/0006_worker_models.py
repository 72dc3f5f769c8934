"""worker_models: the models running workers serve, with their heartbeats

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-01 05:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_models",
        sa.Column("worker", sa.String(256), primary_key=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("endpoints", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False),
        sa.Column("max_model_len", sa.Integer(), nullable=False),
        sa.Column("hostname", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("metrics_port", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_worker_models_model", "worker_models", ["model"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_worker_models_model", table_name="worker_models")
    op.drop_table("worker_models")
