"""One Parquet results file: written atomically, read in batches (never a whole job in memory), counted."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store.filestore.storage import atomic_write, url_to_fs
from store.results.no_pandas import skip_pandas_probe
from store.results.rows import COMPLETED, STATUSES, rows_to_table

COUNT_COLUMNS = ["status", "prompt_tokens", "completion_tokens", "cached_tokens"]


def write_table(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table) -> None:
    with atomic_write(fs, path) as f:
        pq.write_table(table, f)


def write_results(url: str, rows: Iterable[dict] | pa.Table, *, storage_options: dict | None = None) -> str:
    """Write rows (or a schema table) as one Parquet file at a path or fsspec URL, atomically."""
    fs, path = url_to_fs(url, storage_options)
    write_table(fs, path, rows_to_table(rows))
    return path


def read_batches(
    fs: fsspec.AbstractFileSystem, paths: list[str], columns: list[str] | None, batch_size: int = 1024
) -> Iterator[pa.RecordBatch]:
    """The rows of the files, one after the other, in batches of `batch_size`; of `columns`, those a
    file has (parts written before a column was added lack it)."""
    for path in paths:
        with fs.open(path, "rb") as f:
            file = pq.ParquetFile(f)
            present = columns if columns is None else [c for c in columns if c in file.schema_arrow.names]
            yield from file.iter_batches(batch_size=batch_size, columns=present)


@dataclass
class ResultCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those read from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def count_batches(batches: Iterable[pa.RecordBatch]) -> ResultCounts:
    """Completed/failed/cancelled rows and token usage of batches holding `COUNT_COLUMNS`."""
    skip_pandas_probe()
    counts = ResultCounts()
    completed_status = pa.scalar(COMPLETED, pa.string())  # typed: an untyped Python value makes pyarrow import pandas
    for batch in batches:
        counts.total += batch.num_rows
        for entry in pc.value_counts(batch.column("status")).to_pylist():
            if entry["values"] in STATUSES:
                setattr(counts, entry["values"], getattr(counts, entry["values"]) + entry["counts"])
        # usage is what completed requests used: a cancelled or failed request is not billed
        completed = pc.equal(batch.column("status"), completed_status)
        counts.prompt_tokens += pc.sum(pc.filter(batch.column("prompt_tokens"), completed)).as_py() or 0
        counts.completion_tokens += pc.sum(pc.filter(batch.column("completion_tokens"), completed)).as_py() or 0
        if "cached_tokens" in batch.schema.names:
            counts.cached_tokens += pc.sum(pc.filter(batch.column("cached_tokens"), completed)).as_py() or 0
    return counts


def count_table(table: pa.Table) -> ResultCounts:
    return count_batches(table.select(COUNT_COLUMNS).to_batches())


def count_results(url: str, *, storage_options: dict | None = None) -> ResultCounts:
    fs, path = url_to_fs(url, storage_options)
    return count_batches(read_batches(fs, [path], COUNT_COLUMNS, 65536))
