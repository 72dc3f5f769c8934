"""vLLM: tests/entrypoints/llm/test_guided_generate.py (GuidedDecodingParams, the backends that apply: xgrammar,
with and without its disable-any-whitespace option) and tests/v1/entrypoints/llm/test_struct_output_generate.py
(StructuredOutputsParams)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sampling_params import GuidedDecodingParams

BACKENDS = ["xgrammar", "xgrammar:disable-any-whitespace"]

SAMPLE_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
SAMPLE_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "work_history": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "company": {"type": "string", "maxLength": 10},
                    "duration": {"type": "number"},
                    "position": {"type": "string", "maxLength": 10},
                },
                "required": ["company", "position"],
            },
        },
    },
    "required": ["name", "age", "skills", "work_history"],
}
COMPLEX_SCHEMA = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "grade": {"type": "string", "pattern": "^[A-D]$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "maxItems": 3},
    },
    "required": ["score", "grade", "email", "tags"],
}
DEFINITION_SCHEMA = {
    "$defs": {
        "Step": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string", "maxLength": 16},
                "output": {"type": "string", "maxLength": 8},
            },
            "required": ["explanation", "output"],
        }
    },
    "type": "object",
    "properties": {
        "steps": {"type": "array", "items": {"$ref": "#/$defs/Step"}, "maxItems": 2},
        "final_answer": {"type": "string", "maxLength": 8},
    },
    "required": ["steps", "final_answer"],
}
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
        "priority": {"type": "string", "enum": ["low", "medium", "high", "critical"]},
        "category": {
            "type": "object",
            "properties": {
                "type": {"type": "string", "enum": ["bug", "feature", "improvement"]},
                "severity": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
            },
            "required": ["type", "severity"],
        },
        "flags": {"type": "array", "items": {"type": "string", "enum": ["urgent", "blocked"]}, "maxItems": 2},
    },
    "required": ["status", "priority", "category", "flags"],
}
NUMBER_RANGE_SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0.0, "maximum": 100.0},
        "zipcode": {"type": "string", "pattern": r"^\d{5}(-\d{4})?$"},
    },
    "required": ["age", "score", "zipcode"],
}
SAMPLE_SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


def _params(backend, **guided):
    return SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=400, guided_decoding=GuidedDecodingParams(backend=backend, **guided)
    )


@pytest.mark.parametrize("guided_decoding_backend", BACKENDS)
def test_guided_regex(llm: LLM, guided_decoding_backend):
    params = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        guided_decoding=GuidedDecodingParams(regex=SAMPLE_REGEX, backend=guided_decoding_backend),
    )
    outputs = llm.generate([f"Give an example IPv4 address with this regex: {SAMPLE_REGEX}"] * 2, params)
    for output in outputs:
        text = output.outputs[0].text
        assert re.fullmatch(SAMPLE_REGEX, text) is not None, text


@pytest.mark.parametrize("guided_decoding_backend", BACKENDS)
@pytest.mark.parametrize(
    "schema",
    [SAMPLE_JSON_SCHEMA, COMPLEX_SCHEMA, DEFINITION_SCHEMA, ENUM_SCHEMA, NUMBER_RANGE_SCHEMA],
    ids=["json", "complex_json", "definition_json", "enum_json", "number_range_json"],
)
def test_guided_json_completion(llm: LLM, guided_decoding_backend, schema):
    outputs = llm.generate(
        [f"Give an example JSON for an employee profile that fits this schema: {schema}"] * 2,
        _params(guided_decoding_backend, json=schema),
    )
    for output in outputs:
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", text
        jsonschema.validate(instance=json.loads(text), schema=schema)
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', "", text)
        assert "\n" not in outside_strings and "  " not in outside_strings  # both backends: no free whitespace


@pytest.mark.parametrize("guided_decoding_backend", BACKENDS)
def test_guided_choice_completion(llm: LLM, guided_decoding_backend):
    outputs = llm.generate(
        ["The best language for type-safe systems programming is "] * 2,
        _params(guided_decoding_backend, choice=CHOICES),
    )
    for output in outputs:
        assert output.outputs[0].text in CHOICES


@pytest.mark.parametrize("guided_decoding_backend", BACKENDS)
def test_guided_grammar(llm: LLM, guided_decoding_backend):
    params = SamplingParams(
        temperature=0.8,
        top_p=0.95,
        max_tokens=1000,
        guided_decoding=GuidedDecodingParams(grammar=SAMPLE_SQL_GRAMMAR, backend=guided_decoding_backend),
    )
    outputs = llm.generate("Generate a sql state that select col_1 from table_1 where it is equals to 1", params)
    text = outputs[0].outputs[0].text
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", text), text


@pytest.mark.parametrize("guided_decoding_backend", BACKENDS)
def test_guided_json_object(llm: LLM, guided_decoding_backend):
    params = SamplingParams(
        temperature=1.0,
        max_tokens=100,
        n=2,
        guided_decoding=GuidedDecodingParams(json_object=True, backend=guided_decoding_backend),
    )
    outputs = llm.generate("Generate a JSON object with curly braces for a person with name and age fields.", params)
    for completion in outputs[0].outputs:
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
        else:  # a budget run out: the partial text, as vLLM
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_json_with_any_whitespace_disabled(llm: LLM):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0,
        max_tokens=200,
        guided_decoding=GuidedDecodingParams(json=schema, backend="xgrammar:disable-any-whitespace"),
    )
    for output in llm.generate(["Generate a JSON object for a person."] * 3, params):
        text = output.outputs[0].text
        assert "\n" not in text
        jsonschema.validate(json.loads(text), schema)


def test_disable_guided_decoding_fallback(llm: LLM):
    """xgrammar cannot build a lookahead: with no fallback, the request is refused (a ValueError)."""
    params = SamplingParams(
        guided_decoding=GuidedDecodingParams(regex=r"(?=a)b", backend="xgrammar", disable_fallback=True)
    )
    with pytest.raises(ValueError):
        llm.generate("a", params)


def test_validation_against_both_guided_decoding_options():
    with pytest.raises(ValueError):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(choice=CHOICES),
            structured_outputs=StructuredOutputsParams(regex=SAMPLE_REGEX),
        )


@pytest.mark.parametrize(
    "kind,spec",
    [("json", SAMPLE_JSON_SCHEMA), ("regex", SAMPLE_REGEX), ("choice", CHOICES), ("grammar", SAMPLE_SQL_GRAMMAR)],
)
def test_structured_output(llm: LLM, kind, spec):
    """tests/v1/entrypoints/llm/test_struct_output_generate.py::test_structured_output, per kind (xgrammar)."""
    params = SamplingParams(temperature=1.0, max_tokens=400, structured_outputs=StructuredOutputsParams(**{kind: spec}))
    for output in llm.generate(["Give an example that fits."] * 2, params):
        text = output.outputs[0].text
        if kind == "json":
            jsonschema.validate(json.loads(text), spec)
        elif kind == "regex":
            assert re.fullmatch(spec, text)
        elif kind == "choice":
            assert text in spec
        else:
            assert text.startswith("SELECT ")


def test_structured_output_batched_with_non_structured_outputs_requests(llm: LLM):
    """The same test file: one batch mixing a structured request and an unconstrained one."""
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=300, structured_outputs=StructuredOutputsParams(json=SAMPLE_JSON_SCHEMA)
        ),
        SamplingParams(temperature=1.0, max_tokens=50),
    ]
    outputs = llm.generate(["Give an example JSON.", "Tell me a story."], params)
    jsonschema.validate(json.loads(outputs[0].outputs[0].text), SAMPLE_JSON_SCHEMA)
    assert outputs[1].outputs[0].text is not None
