"""`/v1/embeddings` line bodies: OpenAI's input forms and limits, and response bodies that the
official `openai` client's types accept, with base64 vectors that decode to the engine's floats."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from batchfile.embeddings import (
    MAX_INPUTS,
    MAX_LINE_TOKENS,
    embeddings_body,
    fit_inputs,
    read_embedding_body,
)
from batchfile.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_PARAMETER, INVALID_PROMPT, InvalidLine


@pytest.mark.parametrize("value, texts, ids", [
    ("hello", ["hello"], None),
    (["a", "b"], ["a", "b"], None),
    ([1, 2, 3], None, [[1, 2, 3]]),
    ([[1, 2], [3]], None, [[1, 2], [3]]),
])
def test_input_forms(value, texts, ids):
    got = read_embedding_body({"model": "m", "input": value}, vocab_size=512)
    assert (got.texts, got.token_ids, got.encoding_format, len(got)) == (texts, ids, "float", len(texts or ids))


@pytest.mark.parametrize("body, code, message", [
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
    ({"input": "x", "temperature": 1}, INVALID_PARAMETER, "unrecognized embeddings parameter 'temperature'"),
])
def test_bad_bodies_are_line_errors(body, code, message):
    with pytest.raises(InvalidLine, match=message) as info:
        read_embedding_body(body, vocab_size=512)
    assert info.value.code == code


def test_context_and_line_token_limits():
    with pytest.raises(InvalidLine, match=r"input\[1\] is 70 tokens; the model's context length is 64") as info:
        fit_inputs([[1] * 10, [1] * 70], 64, None)
    assert info.value.code == CONTEXT_LENGTH_EXCEEDED
    assert fit_inputs([[1] * 10, list(range(70))], 64, 5) == [[1] * 5, list(range(65, 70))]
    assert fit_inputs([list(range(70))], 64, -1) == [list(range(6, 70))]
    with pytest.raises(InvalidLine, match="exceeds the model's context"):
        fit_inputs([[1]], 64, 65)
    with pytest.raises(InvalidLine, match="at most 300,000 per request"):
        fit_inputs([[1] * 8000] * 38, 8192, None)
    assert sum(map(len, fit_inputs([[1] * 8000] * 37, 8192, None))) < MAX_LINE_TOKENS


def test_bodies_parse_as_openai_types_and_base64_decodes_to_the_engine_vectors(tmp_path):
    from engine import LLM
    from engine.tiny_embedding import write_tiny_embedding_model

    llm = LLM(str(write_tiny_embedding_model(tmp_path / "m", "qwen3", "mean")), num_kv_blocks=32)
    outs = llm.embed(["first input", "a second, longer input"], use_tqdm=False)
    vectors = [o.outputs.embedding for o in outs]
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    plain = CreateEmbeddingResponse.model_validate(embeddings_body("tiny", vectors, tokens))
    assert [d.embedding for d in plain.data] == [list(map(float, v)) for v in vectors]
    assert (plain.object, plain.model, plain.usage.prompt_tokens, plain.usage.total_tokens) == (
        "list", "tiny", tokens, tokens)
    packed = embeddings_body("tiny", vectors, tokens, "base64")
    for i, item in enumerate(packed["data"]):
        assert item["index"] == i and isinstance(item["embedding"], str)
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")  # as the openai client does
        np.testing.assert_array_equal(decoded, np.asarray(vectors[i], dtype=np.float32))
