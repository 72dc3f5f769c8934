"""The result row of a finished `/v1/embeddings` line: OpenAI's body in `response_body` and the
vectors in Parquet columns that readers take as vectors:

- `embedding` (list<float32>): the vector of a line with one input (the common case; pandas
  reads an array per row, DuckDB `FLOAT[]`, polars `List(Float32)`), null for other lines;
- `embeddings` (list<list<float32>>): every vector of a line with several inputs, in input order.

A line has its vectors in exactly one of the two. Not a fixed-size list: parts written by
different workers (and jobs mixing models) must share one schema, whatever the dimension.
`upgrade_embedding_columns` reads a part written before the split (one list<list> column)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

from batchfile.endpoints.embeddings import response_of, usage_tokens
from batchfile.request import ParsedRequest
from store.results.rows import COMPLETED, RESULT_SCHEMA, _times

VECTOR = pa.list_(pa.float32())
VECTORS = pa.list_(VECTOR)


def pooling_row(
    request: ParsedRequest,
    prompt_tokens: int,
    body: dict,
    *,
    shard_id: str | None = None,
    created_at=None,
    started_at=None,
    finished_at=None,
    **columns,
) -> dict:
    """The completed row of a pooling line (embeddings, score, rerank): `body` as its response, no completion."""
    row = dict.fromkeys(RESULT_SCHEMA.names)
    row.update(
        custom_id=request.custom_id,
        line=request.line,
        status=COMPLETED,
        url=request.url,
        model=request.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        response_body=json.dumps(body),
        shard_id=None if shard_id is None else str(shard_id),
        **_times(created_at, started_at, finished_at),
        **columns,
    )
    return row


def embedding_row(
    request: ParsedRequest,
    output,
    *,
    shard_id: str | None = None,
    tokenizer=None,
    created_at=None,
    started_at=None,
    finished_at=None,
) -> dict:
    """`output`: the engine's pooling output for the line's inputs (`outputs.data`, [inputs, dim])."""
    vectors = output.outputs.data.tolist()
    column = {"embedding": vectors[0]} if len(vectors) == 1 else {"embeddings": vectors}
    return pooling_row(
        request,
        usage_tokens(request),
        response_of(request, vectors),
        shard_id=shard_id,
        created_at=created_at,
        started_at=started_at,
        finished_at=finished_at,
        **column,
    )


def upgrade_embedding_columns(table: pa.Table) -> pa.Table:
    """A table whose `embedding` column is the old list<list<float32>> (one vector per input),
    split into `embedding` (lines of one input) and `embeddings` (the others); others unchanged."""
    if "embedding" not in table.column_names or table.schema.field("embedding").type != VECTORS:
        return table
    old = table.column("embedding")
    single = pc.equal(pc.list_value_length(old), 1)
    first = pc.list_element(old, 0) if len(old) else pa.chunked_array([], VECTOR)
    null_vector, null_vectors = pa.scalar(None, VECTOR), pa.scalar(None, VECTORS)
    embedding = pc.if_else(single, first, null_vector).cast(VECTOR)
    embeddings = pc.if_else(single, null_vectors, old).cast(VECTORS)
    table = table.set_column(table.column_names.index("embedding"), "embedding", embedding)
    if "embeddings" in table.column_names:
        return table.set_column(table.column_names.index("embeddings"), "embeddings", embeddings)
    return table.append_column("embeddings", embeddings)
