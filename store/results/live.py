"""A job's result lines while it runs, by cursor: every line exactly once, in the order shards finished.

A shard's part becomes readable when the shard is done (its part was moved into place whole and the database
recorded it), so a consumer never sees a part of a shard that a retry may still replace. Within a part, lines
go in input order (a part rewritten by a late stale attempt holds the same lines, so an offset into it still
names the same lines). The cursor is opaque text holding the shards read whole and how far into the next one
the reader got: it stays correct however the shards' database commits interleave.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

from sqlalchemy import func, select

from store.db import session_scope
from store.errors import NotFound
from store.models import Shard
from store.results.jsonl import JSONL_COLUMNS, result_line
from store.results.parts import results_store
from store.settings import Settings

START = "0"  # the cursor before the first line


@dataclass
class Cursor:
    read: set[int] = field(default_factory=set)  # shard indexes read whole
    shard: int | None = None  # the shard read part of, and how many of its lines
    offset: int = 0

    def encode(self) -> str:
        text = ",".join(_ranges(sorted(self.read))) + (f";{self.shard}:{self.offset}" if self.shard is not None else "")
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=") or START

    @classmethod
    def decode(cls, text: str) -> Cursor:
        if text in ("", START):
            return cls()
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
            whole, _, partial = raw.partition(";")
            read = set()
            for item in filter(None, whole.split(",")):
                low, _, high = item.partition("-")
                read.update(range(int(low), int(high or low) + 1))
            shard, _, offset = partial.partition(":")
            return cls(read, int(shard) if shard else None, int(offset or 0))
        except ValueError:
            raise NotFound("No such cursor: after must be a next_cursor this API gave (or 0)", param="after") from None


def _ranges(indexes: list[int]) -> list[str]:
    out: list[str] = []
    for index in indexes:
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == index - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{index}"
        elif out and "-" not in out[-1] and int(out[-1]) == index - 1:
            out[-1] = f"{out[-1]}-{index}"
        else:
            out.append(str(index))
    return out


def lines_after(settings: Settings, job_id: str, after: str, limit: int) -> tuple[list[dict], str, bool]:
    """Up to `limit` result lines (OpenAI output or error lines, as objects) after the cursor `after`, the
    cursor after them, and whether more are ready now."""
    cursor = Cursor.decode(after)
    with session_scope(settings.database_url) as s:
        sealed = list(s.execute(
            select(Shard.index, Shard.part_key).where(Shard.job_id == job_id, Shard.part_key.is_not(None))
            .order_by(func.coalesce(Shard.finished_at, Shard.created_at), Shard.index)
        ))  # fmt: skip
    store = results_store(settings)
    lines: list[dict] = []
    pending = [(index, key) for index, key in sealed if index not in cursor.read]
    if cursor.shard is not None:  # the shard read part of goes first
        pending.sort(key=lambda item: item[0] != cursor.shard)
    for index, key in pending:
        if len(lines) >= limit:
            return lines, cursor.encode(), True
        skip = cursor.offset if index == cursor.shard else 0
        rows = store.read_part(key).select(JSONL_COLUMNS).slice(skip).to_pylist()
        taken = rows[: limit - len(lines)]
        lines.extend(json.loads(result_line(row, job_id)) for row in taken)
        if len(taken) < len(rows):
            cursor.shard, cursor.offset = index, skip + len(taken)
            return lines, cursor.encode(), True
        cursor.read.add(index)
        cursor.shard, cursor.offset = None, 0
    return lines, cursor.encode(), False
