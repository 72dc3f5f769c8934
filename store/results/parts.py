"""`ResultsStore`: the Parquet parts of jobs (one per shard), their merge, and a job's OpenAI JSONL."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from store.filestore.storage import atomic_write, is_local, url_to_fs
from store.filestore.storage_faults import retrying
from store.results.embedding_rows import upgrade_embedding_columns
from store.results.jsonl import JSONL_COLUMNS, jsonl_lines
from store.results.parquet import COUNT_COLUMNS, ResultCounts, count_batches, read_batches, write_table
from store.results.part_writer import PartWriter
from store.results.rows import RESULT_SCHEMA, rows_to_table
from store.settings import Settings

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _check_id(kind: str, value) -> str:
    value = str(value)
    if not _SAFE_ID.fullmatch(value) or ".." in value:
        raise ValueError(f"{kind} {value!r} is not usable in a path (letters, digits, '.', '_', '-')")
    return value


def results_store(settings: Settings) -> ResultsStore:
    """The platform's results store: under <storage>/results."""
    return ResultsStore(settings.storage_url.rstrip("/") + "/results")


class ResultsStore:
    """Parquet parts and merged results of jobs under one root (a directory or an fsspec URL)."""

    def __init__(self, url: str, *, storage_options: dict | None = None):
        self.url = str(url)
        self.fs, self.root = url_to_fs(self.url, storage_options)

    # paths
    def job_dir(self, job_id) -> str:
        return f"{self.root}/{_check_id('job id', job_id)}"

    def part_path(self, job_id, shard_id) -> str:
        return f"{self.job_dir(job_id)}/parts/{_check_id('shard id', shard_id)}.parquet"

    def merged_path(self, job_id) -> str:
        return f"{self.job_dir(job_id)}/results.parquet"

    def url_for(self, path: str) -> str:
        """A path of this store as a URL that fsspec and pyarrow open from any process."""
        return path if is_local(self.fs) else self.fs.unstrip_protocol(path)

    # parts
    def write_part(self, job_id, shard_id, rows: Iterable[dict] | pa.Table) -> str:
        """Write (or overwrite) the shard's part atomically; returns its path."""
        path = self.part_path(job_id, shard_id)
        write_table(self.fs, path, rows_to_table(rows))
        return path

    def open_part(self, job_id, shard_id, **kwargs) -> PartWriter:
        """A writer of the shard's part, row group by row group; the part appears on `commit`."""
        return PartWriter(self.fs, self.part_path(job_id, shard_id), **kwargs)

    def list_parts(self, job_id) -> list[str]:
        parts_dir = f"{self.job_dir(job_id)}/parts"
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(parts_dir)  # see parts other workers wrote
        try:
            entries = retrying(lambda: self.fs.ls(parts_dir, detail=False), "listing results parts")
        except FileNotFoundError:
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in entries)
        # a name starting with "." is a write in progress (see store.filestore.storage.atomic_write)
        return sorted(f"{parts_dir}/{n}" for n in names if n.endswith(".parquet") and not n.startswith("."))

    def _read(self, path: str, columns=None) -> pa.Table:
        """A Parquet file read whole, again with backoff while the storage fails transiently. A part is small:
        read on this thread (pyarrow's pool cost a 250-row part 3 ms instead of 1 on a busy 2-core host)."""

        def read():
            with self.fs.open(path, "rb") as f:
                return pq.read_table(f, columns=columns, use_threads=False)

        return retrying(read, "reading a results part")

    def _line_range(self, path: str) -> tuple[int, int] | None:
        """The part's first and last line number (None: no rows), from its row groups' statistics where they
        are written (they are, by pyarrow), else from its line column."""

        def read():
            with self.fs.open(path, "rb") as f:
                meta = pq.ParquetFile(f).metadata
            index = meta.schema.to_arrow_schema().get_field_index("line")
            if index < 0:
                return None
            stats = [meta.row_group(i).column(index).statistics for i in range(meta.num_row_groups)]
            if not all(s is not None and s.has_min_max for s in stats):
                return None
            return (min(s.min for s in stats), max(s.max for s in stats)) if stats else ()

        found = retrying(read, "reading a results part")
        if found is None:  # no statistics: the column itself
            lines = self._read(path, ["line"]).column("line")
            found = (pc.min(lines).as_py(), pc.max(lines).as_py()) if len(lines) else ()
        return found or None

    def read_part(self, path: str) -> pa.Table:
        """A part sorted by line (a streamed part holds its rows in the order they finished); one
        written before `embeddings` existed is read into today's schema."""
        table = self._read(path)
        if table.schema != RESULT_SCHEMA:
            table = upgrade_embedding_columns(table)
            for name in RESULT_SCHEMA.names:
                if name not in table.column_names:
                    table = table.append_column(name, pa.nulls(table.num_rows, RESULT_SCHEMA.field(name).type))
            table = table.select(RESULT_SCHEMA.names).cast(RESULT_SCHEMA)
        return table.sort_by("line")

    def _part_batches(self, parts: list[str], columns) -> Iterator[pa.RecordBatch]:
        for part in parts:  # one part in memory at a time
            yield from self.read_part(part).select(columns).to_batches(max_chunksize=1024)

    def count(self, job_id) -> ResultCounts:
        """Completed/failed/cancelled rows and token usage, from the parts."""
        return count_batches(read_batches(self.fs, self.list_parts(job_id), COUNT_COLUMNS, 65536))

    def _ordered_parts(self, job_id) -> tuple[list[str], bool]:
        """Parts ordered by first line, and whether their line ranges are disjoint."""
        ranges = []
        for path in self.list_parts(job_id):
            if (found := self._line_range(path)) is not None:
                ranges.append((*found, path))
        ranges.sort()
        disjoint = all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))
        return [path for _, _, path in ranges], disjoint

    def merge(self, job_id) -> str:
        """All parts of the job as one Parquet file sorted by line, at `merged_path`.

        Parts with disjoint line ranges (shards are contiguous slices) are streamed part by part;
        overlapping ones are sorted in memory.
        """
        path = self.merged_path(job_id)
        parts, disjoint = self._ordered_parts(job_id)
        if not disjoint:
            table = pa.concat_tables([self.read_part(p) for p in parts]).sort_by("line")
            write_table(self.fs, path, table)
            return path
        with atomic_write(self.fs, path) as f, pq.ParquetWriter(f, RESULT_SCHEMA) as writer:
            for part in parts:  # one part in memory at a time
                writer.write_table(self.read_part(part))
        return path

    def _job_batches(self, job_id, columns) -> Iterator[pa.RecordBatch]:
        merged = self.merged_path(job_id)
        if self.fs.exists(merged):
            return read_batches(self.fs, [merged], columns)
        parts, disjoint = self._ordered_parts(job_id)
        if disjoint:
            return self._part_batches(parts, columns)
        table = pa.concat_tables([self.read_part(p).select(columns) for p in parts]).sort_by("line")
        return iter(table.to_batches(max_chunksize=1024))

    def iter_output_jsonl(self, job_id) -> Iterator[str]:
        """OpenAI output lines of the job in line order (from the merged file, else the parts)."""
        return jsonl_lines(self._job_batches(job_id, JSONL_COLUMNS), str(job_id), errors=False)

    def iter_error_jsonl(self, job_id) -> Iterator[str]:
        """OpenAI error lines of the job in line order (from the merged file, else the parts)."""
        return jsonl_lines(self._job_batches(job_id, JSONL_COLUMNS), str(job_id), errors=True)

    def delete_job(self, job_id) -> int:
        """Remove the job's parts and merged file; returns how many files were removed."""
        job_dir = self.job_dir(job_id)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(job_dir)
        try:
            files = self.fs.find(job_dir)
        except FileNotFoundError:
            return 0
        if files:
            self.fs.rm(job_dir, recursive=True)
        return len(files)
