"""cached_tokens: the prompt tokens read from the prefix cache, per job and per shard

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 07:15:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("jobs", "shards"):
        op.add_column(table, sa.Column("cached_tokens", sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    for table in ("jobs", "shards"):
        op.drop_column(table, "cached_tokens")
