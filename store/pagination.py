"""Keyset pagination of a tenant's rows, newest first (or oldest first): stable while rows are added."""

from __future__ import annotations

from sqlalchemy import Select
from sqlalchemy.orm import Session

from store.errors import NotFound


def page(
    session: Session,
    model,
    query: Select,
    tenant: str,
    limit: int,
    after: str | None,
    noun: str,
    *,
    ascending: bool = False,
):
    """One page of `query` (rows of `model`), starting after the row with id `after`;
    returns (rows, whether more follow)."""
    if after:
        anchor = session.get(model, after)
        if anchor is None or anchor.tenant != tenant:
            raise NotFound(f"No such {noun}: {after}", param="after")
        if ascending:
            query = query.where(
                (model.created_at > anchor.created_at)
                | ((model.created_at == anchor.created_at) & (model.id > anchor.id))
            )
        else:
            query = query.where(
                (model.created_at < anchor.created_at)
                | ((model.created_at == anchor.created_at) & (model.id < anchor.id))
            )
    order = (model.created_at.asc(), model.id.asc()) if ascending else (model.created_at.desc(), model.id.desc())
    rows = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
