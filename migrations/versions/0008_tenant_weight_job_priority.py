"""tenants.weight (fair share in a worker) and jobs.priority (lower first, within a tenant)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 09:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Float(), server_default="1", nullable=False))
    op.create_check_constraint("ck_tenants_weight", "tenants", "weight > 0")
    op.add_column("jobs", sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
    op.create_check_constraint("ck_jobs_priority", "jobs", "priority BETWEEN -100 AND 100")


def downgrade() -> None:
    op.drop_constraint("ck_jobs_priority", "jobs", type_="check")
    op.drop_column("jobs", "priority")
    op.drop_constraint("ck_tenants_weight", "tenants", type_="check")
    op.drop_column("tenants", "weight")
