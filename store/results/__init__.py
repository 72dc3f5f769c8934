"""Parquet results: one row per request line, one part file per shard, merged per job.

Layout in a results store (a local directory or any fsspec URL, e.g. ``s3://bucket/results``)::

    <root>/<job id>/parts/<shard id>.parquet   one part per shard; a rewritten shard overwrites it
    <root>/<job id>/results.parquet            all parts merged, sorted by line

- `rows`: the schema and the row of each outcome (completed, failed, cancelled, expired);
- `parquet`: write one results file atomically, read it in batches, count it;
- `jsonl`: OpenAI batch output and error lines from the rows;
- `parts`: `ResultsStore`, a job's parts, their merge, and the job's JSONL.
"""
