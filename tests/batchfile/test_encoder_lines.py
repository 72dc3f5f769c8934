"""`/v1/score` and `/v1/rerank` lines (vLLM's bodies) and `/v1/embeddings` lines on encoder models:
validated like the other lines, a line for an endpoint the model cannot serve is that line's error,
results in Parquet (`scores`, `embedding` columns) with vLLM's response bodies."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchfile.endpoints.scoring import read_line
from batchfile.errors import INVALID_PARAMETER, INVALID_PROMPT, INVALID_URL, InvalidLine
from engine import LLM
from engine.testing.tiny_encoder import write_tiny_classifier, write_tiny_encoder
from workers.offline import run_offline

DOCS = ["The quick brown fox.", "Paged attention stores blocks.", "Привет, мир", "fox fox fox"]


def _line(custom_id, url, body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


def _run(tmp_path, model, lines):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    run_offline(str(src), str(tmp_path / "out.parquet"), str(model), progress=False)
    return {r["custom_id"]: r for r in pq.read_table(tmp_path / "out.parquet").to_pylist()}


@pytest.mark.parametrize(
    "url, body, code, message",
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, INVALID_PROMPT, "two lists of one length"),
        ("/v1/score", {"text_1": "a"}, INVALID_PROMPT, "text_2 must be"),
        ("/v1/score", {"text_1": "a", "text_2": [1]}, INVALID_PROMPT, r"text_2\[0\] must be a string"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "top_n": 2}, INVALID_PARAMETER, "unrecognized score parameter"),
        ("/v1/rerank", {"query": "q", "documents": "one"}, INVALID_PROMPT, "documents must be a non-empty array"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, INVALID_PROMPT, "query must be a string"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, INVALID_PARAMETER, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0}, INVALID_PARAMETER, "truncate"),
    ],
)
def test_bad_bodies_are_line_errors(url, body, code, message):
    with pytest.raises(InvalidLine, match=message) as info:
        read_line(url, body, body)
    assert info.value.code == code


def test_cross_encoder_score_and_rerank_lines(tmp_path):
    model = write_tiny_classifier(tmp_path / "ce", "bert", num_labels=1)
    rows = _run(
        tmp_path,
        model,
        [
            _line("s", "/v1/score", {"text_1": "what is a fox?", "text_2": DOCS}),
            _line("r", "/v1/rerank", {"query": "what is a fox?", "documents": DOCS, "top_n": 2}),
            _line("nodocs", "/v1/rerank", {"query": "what is a fox?", "documents": DOCS, "return_documents": False}),
            _line("e", "/v1/embeddings", {"input": "hi"}),
            _line("c", "/v1/completions", {"prompt": "hi"}),
            _line("long", "/v1/score", {"text_1": "fox " * 200, "text_2": "fox " * 200}),
        ],
    )
    want = [o.outputs.score for o in LLM(str(model)).score("what is a fox?", DOCS, use_tqdm=False)]
    assert rows["s"]["status"] == "completed"
    np.testing.assert_allclose(rows["s"]["scores"], want, atol=1e-6)
    body = json.loads(rows["s"]["response_body"])
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == rows["s"]["prompt_tokens"] > 0
    rerank = json.loads(rows["r"]["response_body"])
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    assert [r["document"]["text"] for r in rerank["results"]] == [DOCS[i] for i in order]
    np.testing.assert_allclose(rows["r"]["scores"], want, atol=1e-6)  # the column: every document, in order
    assert all("document" not in r for r in json.loads(rows["nodocs"]["response_body"])["results"])
    assert len(json.loads(rows["nodocs"]["response_body"])["results"]) == len(DOCS)
    for cid in ("e", "c"):
        assert (rows[cid]["status"], rows[cid]["error_code"]) == ("failed", INVALID_URL)
    assert "classifier (cross-encoder)" in rows["e"]["error_message"]
    assert (rows["long"]["status"], rows["long"]["error_code"]) == ("failed", "context_length_exceeded")


def test_embedder_serves_embeddings_score_and_rerank_lines(tmp_path):
    model = write_tiny_encoder(tmp_path / "emb", "xlm-roberta", "mean", True)
    rows = _run(
        tmp_path,
        model,
        [
            _line("e", "/v1/embeddings", {"input": ["hello", "Привет"]}),
            _line("s", "/v1/score", {"text_1": "a fox", "text_2": DOCS}),
            _line("r", "/v1/rerank", {"query": "a fox", "documents": DOCS}),
            _line("g", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ],
    )
    llm = LLM(str(model))
    np.testing.assert_allclose(
        rows["e"]["embeddings"],
        [o.outputs.embedding for o in llm.embed(["hello", "Привет"], use_tqdm=False)],
        atol=1e-6,
    )
    want = [o.outputs.score for o in llm.score("a fox", DOCS, use_tqdm=False)]
    np.testing.assert_allclose(rows["s"]["scores"], want, atol=1e-5)
    ranked = [r["index"] for r in json.loads(rows["r"]["response_body"])["results"]]
    assert ranked == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert (rows["g"]["status"], rows["g"]["error_code"]) == ("failed", INVALID_URL)


def test_generative_model_refuses_score_lines(tmp_path):
    from engine.testing.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "gen", "llama")
    rows = _run(
        tmp_path,
        model,
        [
            _line("s", "/v1/score", {"text_1": "a", "text_2": "b"}),
            _line("c", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),  # a file needs one request line
        ],
    )
    assert (rows["s"]["status"], rows["s"]["error_code"]) == ("failed", INVALID_URL)
    assert rows["c"]["status"] == "completed"
    assert "generative model" in rows["s"]["error_message"]


def test_tiny_model_command_writes_encoders(tmp_path):
    from pagedbatch.cli import main

    assert main(["tiny-model", str(tmp_path / "e"), "--encoder", "modernbert", "--pooling", "cls"]) == 0
    assert main(["tiny-model", str(tmp_path / "ce"), "--encoder", "xlm-roberta", "--cross-encoder"]) == 0
    assert main(["tiny-model", str(tmp_path / "cl"), "--encoder", "bert", "--classifier", "4"]) == 0
    assert len(LLM(str(tmp_path / "e")).embed(["hi"], use_tqdm=False)[0].outputs.embedding) == 64
    assert isinstance(LLM(str(tmp_path / "ce")).score("q", ["d"], use_tqdm=False)[0].outputs.score, float)
    assert LLM(str(tmp_path / "cl")).classify(["hi"], use_tqdm=False)[0].outputs.num_classes == 4
