"""`PartWriter`: a shard's rows written to its Parquet part as they come, in row groups, never all held.

The part is written under a temporary name and appears only on `commit` (see `store.filestore.storage.atomic_write`);
`discard` (an attempt that lost its shard, or was handed back) leaves nothing visible; the temporary file of an
attempt whose worker died is removed by the attempt that commits the part. Rows are written in
the order they finish, each row group sorted by line; readers of a part sort it (`ResultsStore`).
"""

from __future__ import annotations

import contextlib

import fsspec
import pyarrow.parquet as pq

from store.filestore.storage import atomic_write
from store.results.rows import RESULT_SCHEMA, rows_to_table

ROW_GROUP_ROWS = 256  # the most rows held before they are written (a shard of short answers: one row group)
ROW_GROUP_BYTES = 4 << 20  # or fewer rows, once their texts, token ids and vectors reach this: a worker's
# memory is bounded by this, not by the shard (32 rows of 128 KB answers). Row groups of 32 rows cost a shard
# of short answers 40 us per row to write and its job's merge 3 ms per part to read; 256 rows: 25 us, 1 ms.


class _Discarded(Exception):
    pass


class PartWriter:
    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        path: str,
        row_group_rows: int = ROW_GROUP_ROWS,
        row_group_bytes: int = ROW_GROUP_BYTES,
    ):
        self.path = path
        self.row_group_rows = row_group_rows
        self.row_group_bytes = row_group_bytes
        self._bytes = 0  # the held rows' size, as `_row_bytes` estimates it
        self.rows_written = 0
        self.max_rows_held = 0  # the most rows this writer held at once (for tests and logs)
        self._fs = fs
        self._rows: list[dict] = []
        self._files = contextlib.ExitStack()
        out = self._files.enter_context(atomic_write(fs, path))
        self._writer = self._files.enter_context(pq.ParquetWriter(out, RESULT_SCHEMA))

    def add(self, row: dict) -> None:
        self._rows.append(row)
        self._bytes += _row_bytes(row)
        self.max_rows_held = max(self.max_rows_held, len(self._rows))
        if len(self._rows) >= self.row_group_rows or self._bytes >= self.row_group_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(rows_to_table(self._rows))
            self.rows_written += len(self._rows)
            self._rows, self._bytes = [], 0

    def commit(self) -> str:
        """Write what is held, close the file and move it into place; returns the part's path."""
        try:
            self._flush()
        except BaseException as exc:
            self._files.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self._files.close()
        self._remove_leftovers()
        return self.path

    def _remove_leftovers(self) -> None:
        """Temporary files of earlier attempts at this part whose worker died mid-write (ours is renamed)."""
        parent, name = self.path.rsplit("/", 1)
        with contextlib.suppress(Exception):
            for leftover in self._fs.glob(f"{parent}/.{name}.*.tmp"):
                with contextlib.suppress(Exception):
                    self._fs.rm(leftover)

    def discard_with_leftovers(self) -> None:
        """Drop the part and the earlier attempts' temporary files: no attempt writes this part any more."""
        self.discard()
        self._remove_leftovers()

    def discard(self) -> None:
        """Drop the part: the temporary file is removed, nothing appears at `path`."""
        self._rows, self._bytes = [], 0
        error = _Discarded()
        self._files.__exit__(_Discarded, error, None)


def _row_bytes(row: dict) -> int:
    """About what a row holds: its texts (characters) and its lists (4 bytes an item; a list of vectors by its
    first one), the rest being a few hundred bytes at most."""
    size = 256
    for name in ("response_body", "output_text", "error_message"):
        size += len(row.get(name) or "")
    for name in ("output_token_ids", "embedding", "scores"):
        size += 4 * len(row.get(name) or ())
    if vectors := row.get("embeddings"):
        size += 4 * len(vectors) * len(vectors[0])
    return size
