"""JSON's whitespace under structured outputs: compact by default for json and json_object (a small model given free
whitespace spends its budget on it), any whitespace when a request says `disable_any_whitespace=False` (vLLM's
default), per request in the engine and in a batch line beside `response_format`; a budget that still runs out
ends with finish_reason "length" and the partial text."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from batchfile.endpoints.structured import from_body
from batchfile.errors import InvalidLine
from engine import SamplingParams, StructuredOutputsParams
from engine.sampling.grammar_cache import _grammar

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _accepts(spec: StructuredOutputsParams, text: str) -> bool:
    return xgr.testing._is_grammar_accept_string(_grammar(spec), text)


@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_json_is_compact_unless_a_request_allows_any_whitespace(kind):
    spec = {"json": SCHEMA} if kind == "json" else {"json_object": True}
    compact, spaced = '{"a":1,"b":["x","y"]}', '{ "a": 1,\n  "b": [ "x", "y" ] }'
    default = StructuredOutputsParams(**spec)
    assert default.compact_whitespace and default.to_dict() == spec
    assert _accepts(default, compact) and not _accepts(default, spaced)
    assert not _accepts(default, '{"a": 1, "b": ["x"]}')  # not even json.dumps' default separators
    vllms = StructuredOutputsParams(**spec, disable_any_whitespace=True)  # vLLM's: xgrammar's separators, no more
    assert _accepts(vllms, '{"a": 1, "b": ["x", "y"]}') and not _accepts(vllms, spaced)
    anywhere = StructuredOutputsParams(**spec, disable_any_whitespace=False)
    assert _accepts(anywhere, spaced) and _accepts(anywhere, compact)
    assert anywhere.to_dict() == {**spec, "disable_any_whitespace": False}  # survives a shard input line
    assert SamplingParams(structured_outputs=anywhere.to_dict()).structured_outputs == anywhere
    with pytest.raises(ValueError, match="disable_any_whitespace must be a boolean"):
        StructuredOutputsParams(**spec, disable_any_whitespace="no")


def test_a_batch_line_tunes_response_format_with_structured_outputs_options():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert from_body({"response_format": fmt}).compact_whitespace
    tuned = from_body({"response_format": fmt, "structured_outputs": {"disable_any_whitespace": False}})
    assert tuned.json == SCHEMA and not tuned.compact_whitespace
    assert not from_body(
        {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": False}}
    ).compact_whitespace
    with pytest.raises(InvalidLine, match="tune a constraint"):
        from_body({"structured_outputs": {"disable_any_whitespace": False}})
    with pytest.raises(InvalidLine, match="both constrain"):
        from_body({"response_format": fmt, "structured_outputs": {"json": SCHEMA}})


def test_a_budget_that_runs_out_gives_length_and_the_partial_text(tiny_model):
    from engine import LLM

    llm = LLM(str(tiny_model("qwen3")), device="cpu", dtype="float32", num_kv_blocks=32, attention_backend="torch")
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    out = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text == '{"a"'  # the first tokens of the compact rendering (tokens of one char here)
    with pytest.raises(ValueError):
        json.loads(out.text)
