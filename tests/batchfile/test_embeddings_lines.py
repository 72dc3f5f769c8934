"""`/v1/embeddings` line bodies: OpenAI's input forms and limits, and response bodies that the
official `openai` client's types accept, with base64 vectors that decode to the engine's floats."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from batchfile.endpoints.embeddings import (
    MAX_INPUTS,
    MAX_LINE_TOKENS,
    embeddings_body,
    fit_inputs,
    read_embedding_body,
)
from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_PARAMETER, INVALID_PROMPT, InvalidLine


@pytest.mark.parametrize(
    "value, texts, ids",
    [
        ("hello", ["hello"], None),
        (["a", "b"], ["a", "b"], None),
        ([1, 2, 3], None, [[1, 2, 3]]),
        ([[1, 2], [3]], None, [[1, 2], [3]]),
    ],
)
def test_input_forms(value, texts, ids):
    got = read_embedding_body({"model": "m", "input": value}, vocab_size=512)
    assert (got.texts, got.token_ids, got.encoding_format, len(got)) == (texts, ids, "float", len(texts or ids))


@pytest.mark.parametrize(
    "body, code, message",
    [
        ({"input": ""}, INVALID_PROMPT, "empty string"),
        ({"input": []}, INVALID_PROMPT, "empty array"),
        ({"input": ["a", ""]}, INVALID_PROMPT, r"input\[1\] must not be an empty string"),
        ({"input": ["a", 1]}, INVALID_PROMPT, "not a mix"),
        ({"input": [[1], []]}, INVALID_PROMPT, r"input\[1\] must not be empty"),
        ({"input": [1, True]}, INVALID_PROMPT, "not a mix"),
        ({"input": [[1, 600]]}, INVALID_PROMPT, "token id 600, outside the vocabulary"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, INVALID_PROMPT, "at most 2,048"),
        ({"input": {"a": 1}}, INVALID_PROMPT, "string or an array"),
        ({}, INVALID_PROMPT, "missing"),
        ({"input": "x", "encoding_format": "int8"}, INVALID_PARAMETER, "encoding_format"),
        ({"input": "x", "dimensions": 0}, INVALID_PARAMETER, "dimensions must be a positive integer"),
        ({"input": "x", "dimensions": True}, INVALID_PARAMETER, "dimensions"),
        ({"input": "x", "user": 5}, INVALID_PARAMETER, "user must be a string"),
        ({"input": "x", "truncation_side": "middle"}, INVALID_PARAMETER, "truncation_side must be 'left' or 'right'"),
        ({"input": "x", "temperature": 1}, INVALID_PARAMETER, "unrecognized embeddings parameter 'temperature'"),
    ],
)
def test_bad_bodies_are_line_errors(body, code, message):
    with pytest.raises(InvalidLine, match=message) as info:
        read_embedding_body(body, vocab_size=512)
    assert info.value.code == code


def test_context_and_line_token_limits():
    with pytest.raises(InvalidLine, match=r"input\[1\] is 70 tokens; the model's context length is 64") as info:
        fit_inputs([[1] * 10, [1] * 70], 64, None)
    assert info.value.code == CONTEXT_LENGTH_EXCEEDED
    assert fit_inputs([[1] * 10, list(range(70))], 64, 5) == [[1] * 5, list(range(5))]  # the first, as vLLM
    assert fit_inputs([[1] * 10, list(range(70))], 64, 5, "left") == [[1] * 5, list(range(65, 70))]
    assert fit_inputs([list(range(70))], 64, -1) == [list(range(64))]
    with pytest.raises(InvalidLine, match="exceeds the model's context"):
        fit_inputs([[1]], 64, 65)
    with pytest.raises(InvalidLine, match="at most 300,000 per request"):
        fit_inputs([[1] * 8000] * 38, 8192, None)
    assert sum(map(len, fit_inputs([[1] * 8000] * 37, 8192, None))) < MAX_LINE_TOKENS


def test_bodies_parse_as_openai_types_and_base64_decodes_to_the_engine_vectors(tmp_path):
    from engine import LLM
    from engine.testing.tiny_embedding import write_tiny_embedding_model

    llm = LLM(str(write_tiny_embedding_model(tmp_path / "m", "qwen3", "mean")), num_kv_blocks=32)
    outs = llm.embed(["first input", "a second, longer input"], use_tqdm=False)
    vectors = [o.outputs.embedding for o in outs]
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    plain = CreateEmbeddingResponse.model_validate(embeddings_body("tiny", vectors, tokens))
    assert [d.embedding for d in plain.data] == [list(map(float, v)) for v in vectors]
    assert (plain.object, plain.model, plain.usage.prompt_tokens, plain.usage.total_tokens) == (
        "list",
        "tiny",
        tokens,
        tokens,
    )
    packed = embeddings_body("tiny", vectors, tokens, "base64")
    for i, item in enumerate(packed["data"]):
        assert item["index"] == i and isinstance(item["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")  # as the openai client does
        np.testing.assert_array_equal(decoded, np.asarray(vectors[i], dtype=np.float32))


def test_embedding_lines_validate_run_and_land_in_parquet_and_jsonl(tmp_path, tiny_model):
    """Lines through validation (per-line errors for what cannot run), the shard-input format, the
    worker's engine host and rows, into Parquet (read back by pandas and DuckDB) and OpenAI's output JSONL;
    every vector equals the offline engine's."""
    import io
    import json

    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchfile.model_limits import ModelLimits
    from batchfile.shard_input import BadLine, decode_request, validate_stream
    from engine import LLM, LLMEngine, PoolingParams
    from engine.testing.tiny_embedding import write_tiny_embedding_model
    from store.results.jsonl import JSONL_COLUMNS, jsonl_lines
    from store.results.rows import rows_to_table
    from workers.host.engine_host import EngineHost
    from workers.line_requests import engine_request
    from workers.shard_runner import _Attempt, _row

    emb = write_tiny_embedding_model(
        tmp_path / "emb",
        "qwen3",
        "mean",
        matryoshka_dimensions=[16, 64],
        default_prompt="query: ",
        max_position_embeddings=128,
    )
    models = {
        "emb": ModelLimits.from_dir(emb, name="emb"),
        "gen": ModelLimits.from_dir(tiny_model("qwen3"), name="gen"),
    }

    def line(cid, body, url="/v1/embeddings"):
        return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "emb", **body}}

    lines = [
        line("one", {"input": "hello world"}),
        line("many", {"input": ["first text", "a second, longer text"], "encoding_format": "base64"}),
        line("ids", {"input": [[5, 6, 7], [8, 9]], "dimensions": 16, "user": "u1"}),
        line("long", {"input": "word " * 200}),
        line("cut", {"input": [list(range(1, 200))], "truncate_prompt_tokens": 50}),
        line("dims", {"input": "x", "dimensions": 20}),
        line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"),
        {**line("gen", {"input": "x"}), "body": {"model": "gen", "input": "x"}},
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    items = list(validate_stream(io.BytesIO(data), models))
    errors = {lines[i]["custom_id"]: it.error.code for i, it in enumerate(items) if isinstance(it, BadLine)}
    assert errors == {
        "long": "context_length_exceeded",
        "dims": "invalid_parameter",
        "chat": "invalid_url",
        "gen": "invalid_url",
    }
    requests = [decode_request(it.shard_line) for it in items if not isinstance(it, BadLine)]
    assert [r.custom_id for r in requests] == ["one", "many", "ids", "cut"]
    assert requests[3].inputs == [list(range(1, 51))]

    llm = LLM(str(emb), num_kv_blocks=64)  # the offline engine: the reference vectors
    expected = [
        [o.outputs.embedding for o in llm.embed(["hello world"], use_tqdm=False)],
        [o.outputs.embedding for o in llm.embed(["first text", "a second, longer text"], use_tqdm=False)],
        [
            o.outputs.embedding
            for o in llm.embed(
                [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                pooling_params=PoolingParams(dimensions=16),
                use_tqdm=False,
            )
        ],
        [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": list(range(1, 51))}], use_tqdm=False)],
    ]
    host = EngineHost(lambda: LLMEngine(str(emb), num_kv_blocks=64))
    try:
        ids = [f"s/1/{r.line}" for r in requests]
        attempt = _Attempt(ids, dict(zip(ids, requests)))
        futures = host.submit_many([engine_request(rid, r) for rid, r in zip(ids, requests)])
        rows = [_row(attempt, rid, f, "s", None, None) for rid, f in zip(ids, futures)]  # _row waits for f
    finally:
        host.close()
    path = tmp_path / "results.parquet"
    pq.write_table(rows_to_table(rows), path)
    single = [True, False, False, True]  # lines of one input: `embedding`; of several: `embeddings`
    schema = pq.read_schema(path)
    assert schema.field("embedding").type == pa.list_(pa.float32())
    assert schema.field("embeddings").type == pa.list_(pa.list_(pa.float32()))

    def check(one, many):  # one reader's two columns, row by row
        for got_one, got_many, want, is_single in zip(one, many, expected, single):
            want = np.asarray(want, dtype=np.float32)
            if is_single:
                assert got_many is None
                np.testing.assert_array_equal(np.asarray(got_one, dtype=np.float32), want[0])
            else:
                assert got_one is None
                np.testing.assert_array_equal(np.stack([np.asarray(v, dtype=np.float32) for v in got_many]), want)

    frame = pd.read_parquet(path)
    assert frame["embedding"][0].dtype == np.float32  # pandas: a float32 array per row
    check([None if v is None else v for v in frame["embedding"]], list(frame["embeddings"]))
    assert frame["prompt_tokens"].tolist()[2:] == [5, 50] and frame["completion_tokens"].tolist() == [0] * 4
    import duckdb

    column = duckdb.sql(
        f"select embedding, embeddings, typeof(embedding), typeof(embeddings) from '{path}' order by line"
    ).fetchall()
    assert {(a, b) for *_, a, b in column} == {("FLOAT[]", "FLOAT[][]")}
    check([r[0] for r in column], [r[1] for r in column])
    dim = len(expected[0][0])
    sims = duckdb.sql(
        f"select array_cosine_similarity(embedding::FLOAT[{dim}], embedding::FLOAT[{dim}]) "
        f"from '{path}' "
        "where embedding is not null"
    ).fetchall()  # usable as a fixed-size vector
    assert [round(s, 5) for (s,) in sims] == [1.0, 1.0]
    import polars as pl

    frame = pl.read_parquet(path)
    assert frame.schema["embedding"] == pl.List(pl.Float32)
    assert frame.schema["embeddings"] == pl.List(pl.List(pl.Float32))
    check(frame["embedding"].to_list(), frame["embeddings"].to_list())
    matrix = frame["embedding"].drop_nulls().cast(pl.Array(pl.Float32, dim)).to_numpy()  # a [rows, dim] matrix
    np.testing.assert_array_equal(matrix, np.asarray([expected[0][0], expected[3][0]], dtype=np.float32))
    table = pq.read_table(path, columns=JSONL_COLUMNS)
    out = [json.loads(x) for x in jsonl_lines(table.to_batches(), "seed", errors=False)]
    assert [o["custom_id"] for o in out] == ["one", "many", "ids", "cut"]
    for o, want in zip(out, expected):
        body = o["response"]["body"]
        if o["custom_id"] == "many":
            vectors = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
        else:
            vectors = [d.embedding for d in CreateEmbeddingResponse.model_validate(body).data]
        np.testing.assert_array_equal(np.asarray(vectors, dtype=np.float32), np.asarray(want, dtype=np.float32))
        assert body["model"] == "emb" and o["response"]["status_code"] == 200


def test_offline_run_embeds_lines(tmp_path):
    """`pagedbatch run` (the offline path) on embeddings lines: the vectors of `LLM.embed`."""
    import json

    import pyarrow.parquet as pq

    from engine import LLM
    from engine.testing.tiny_embedding import write_tiny_embedding_model
    from workers.offline import run_offline

    emb = write_tiny_embedding_model(tmp_path / "emb", "llama", "cls")
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "x", "input": ["hi", "yo"]}},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": "hi"}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_offline(str(src), str(tmp_path / "out.parquet"), str(emb), progress=False, engine_kwargs={"num_kv_blocks": 16})
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [(r["custom_id"], r["status"], r["error_code"]) for r in rows] == [
        ("a", "completed", None),
        ("b", "failed", "invalid_url"),
    ]
    expected = [o.outputs.embedding for o in LLM(str(emb), num_kv_blocks=16).embed(["hi", "yo"], use_tqdm=False)]
    assert rows[0]["embedding"] is None  # two inputs: the vectors are in `embeddings`
    np.testing.assert_array_equal(np.asarray(rows[0]["embeddings"]), np.asarray(expected, dtype=np.float32))


def test_merge_reads_parts_written_with_the_old_embedding_column(tmp_path):
    """A part written before the split (`embedding` list<list<float32>>, no `embeddings`) merges
    into today's schema: a one-input line's vector in `embedding`, several in `embeddings`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from store.results.parts import ResultsStore
    from store.results.rows import RESULT_SCHEMA, rows_to_table

    store = ResultsStore(str(tmp_path / "results"))
    new = rows_to_table([{"line": 3, "status": "completed", "embedding": [0.5, 0.25]}])
    store.write_part("j", "b", new.to_pylist())
    old_schema = pa.schema([f for f in RESULT_SCHEMA if f.name != "embeddings"]).set(
        RESULT_SCHEMA.get_field_index("embedding"), pa.field("embedding", pa.list_(pa.list_(pa.float32())))
    )
    old = pa.Table.from_pylist(
        [
            {"line": 2, "status": "completed", "embedding": [[1.0, 2.0], [3.0, 4.0]]},
            {"line": 1, "status": "completed", "embedding": [[5.0, 6.0]]},
            {"line": 0, "status": "failed", "embedding": None},
        ],
        schema=old_schema,
    )
    path = store.part_path("j", "a")
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with store.fs.open(path, "wb") as f:
        pq.write_table(old, f)
    merged = pq.read_table(store.merge("j"))
    assert merged.schema == RESULT_SCHEMA
    assert merged.select(["line", "embedding", "embeddings"]).to_pylist() == [
        {"line": 0, "embedding": None, "embeddings": None},
        {"line": 1, "embedding": [5.0, 6.0], "embeddings": None},
        {"line": 2, "embedding": None, "embeddings": [[1.0, 2.0], [3.0, 4.0]]},
        {"line": 3, "embedding": [0.5, 0.25], "embeddings": None},
    ]
