"""shard leases: a heartbeat deadline per shard, for recovery from dead workers and lost broker messages

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("shards", sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_shards_status_lease", "shards", ["status", "lease_until"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_shards_status_lease", table_name="shards")
    op.drop_column("shards", "lease_until")
