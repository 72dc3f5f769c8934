"""worker_models.adapters: the LoRA adapters a worker serves over its model ({name: directory})

Revision ID: 0011_i32l
Revises: 0010_i43
Create Date: 2026-12-06 04:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0011_i32l"
down_revision: str | None = "0010_i43"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("worker_models", sa.Column("adapters", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    op.drop_column("worker_models", "adapters")
