"""prefix plans and quotes: jobs' planned prompt, cached and completion tokens; workers' measured throughput

Revision ID: 0013_i35b
Revises: 0012_i35a
Create Date: 2026-12-06 06:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013_i35b"
down_revision: str | None = "0012_i35a"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
PLANNED = ("planned_prompt_tokens", "planned_cached_tokens", "planned_completion_tokens")


def upgrade() -> None:
    for name in PLANNED:
        op.add_column("jobs", sa.Column(name, sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("worker_models", sa.Column("throughput", JSON, nullable=True))


def downgrade() -> None:
    op.drop_column("worker_models", "throughput")
    for name in PLANNED:
        op.drop_column("jobs", name)
