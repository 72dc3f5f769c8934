"""shards.error dropped: written only when a poisoned shard was split (the worker logs that) and read nowhere

Revision ID: 0009_i36
Revises: 0008
Create Date: 2026-12-05 19:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_i36"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_column("shards", "error")


def downgrade() -> None:
    op.add_column("shards", sa.Column("error", sa.Text(), nullable=True))
