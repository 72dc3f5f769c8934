"""The API's objects: what the serializers emit is what OpenAI's own client types accept, and what the
OpenAPI document's components.schemas describe (every field sent, nothing undeclared)."""

from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from jsonschema_rs import Draft202012Validator  # schemathesis's validator
from openai.types import Batch as OpenAIBatch
from openai.types import FileObject as OpenAIFile
from openai.types import Model as OpenAIModel

from api import objects
from api.errors import error_response
from api.serializers import batch_object, file_object, job_object, page
from api.spec.openapi import component_schemas, openapi_document
from store.lifecycle.progress import Progress
from store.models import JOB_STATUSES, File, Job

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def _file(**overrides) -> File:
    fields = dict(id="file-abc", bytes=1234, created_at=NOW, filename="input.jsonl", purpose="batch")
    return File(**(fields | overrides))


def _job(status: str, **overrides) -> Job:
    fields = dict(
        id="batch_abc",
        status=status,
        endpoint="/v1/chat/completions",
        model="tiny",
        defaults=None,
        job_metadata=None,
        input_file_id="file-abc",
        completion_window="24h",
        request_total=5,
        invalid_lines=0,
        shard_count=1,
        errors=None,
        created_at=NOW,
        expires_at=NOW + timedelta(hours=24),
    )
    return Job(**(fields | overrides))


PROGRESS = Progress(
    completed=3, failed=1, cancelled=0, prompt_tokens=40, completion_tokens=12, requests_done=4, requests_valid=4
)
LINE_ERRORS = [
    {"code": "invalid_json", "message": "line 2 is not JSON", "param": None, "line": 2},
    {"code": "empty_file", "message": "The input file has no requests.", "param": None, "line": None},
]

JOBS = [_job(status) for status in JOB_STATUSES] + [
    _job(
        "completed",
        endpoint=None,
        model=None,
        defaults={"temperature": 0.5, "stop": ["\n"]},
        job_metadata={"team": "search", "k" * 64: "v" * 512},
        invalid_lines=1,
        errors=LINE_ERRORS,
        output_file_id="file-out",
        error_file_id="file-err",
        in_progress_at=NOW,
        finalizing_at=NOW,
        completed_at=NOW,
    ),
    _job("validating", request_total=0, errors=LINE_ERRORS[1:]),
]
FILES = [_file(), _file(purpose="batch_output", bytes=0, filename="batch_abc_output.jsonl")]


def _emitted(obj: objects.ApiObject) -> dict:
    return obj.model_dump(mode="json")


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.status)
def test_batch_is_an_openai_batch(job):
    body = _emitted(batch_object(job, PROGRESS))
    parsed = OpenAIBatch.model_validate(body, strict=True)
    assert set(body) <= set(OpenAIBatch.model_fields)  # no field OpenAI's client does not know
    assert parsed.model_dump(mode="json", exclude_unset=True) == body


@pytest.mark.parametrize("record", FILES, ids=lambda record: record.purpose)
def test_file_is_an_openai_file(record):
    body = _emitted(file_object(record))
    parsed = OpenAIFile.model_validate(body, strict=True)
    assert set(body) <= set(OpenAIFile.model_fields)
    assert parsed.model_dump(mode="json", exclude_unset=True) == body


def test_model_is_an_openai_model():
    body = _emitted(objects.Model(id="tiny"))
    parsed = OpenAIModel.model_validate(body, strict=True)
    assert parsed.model_dump(mode="json", exclude_unset=True) == body


def _validator(name: str) -> Draft202012Validator:
    """A validator for one component, its refs resolved within the served document."""
    document = openapi_document()
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": document["components"]})


def _error_body() -> dict:
    with Flask(__name__).app_context():
        response, _ = error_response(404, "No job with id batch_x", param=None, code="not_found")
        return response.get_json()


EMITTED = {
    "Batch": [_emitted(batch_object(job, PROGRESS)) for job in JOBS],
    "Job": [_emitted(job_object(job, PROGRESS)) for job in JOBS],
    "File": [_emitted(file_object(record)) for record in FILES],
    "BatchList": [_emitted(page(objects.BatchList, [batch_object(job, PROGRESS) for job in JOBS], True))],
    "JobList": [_emitted(page(objects.JobList, [], False))],
    "FileList": [_emitted(page(objects.FileList, [file_object(record) for record in FILES], False))],
    "ModelList": [_emitted(objects.ModelList(data=[objects.Model(id="tiny")]))],
    "ErrorResponse": [_error_body()],
}


@pytest.mark.parametrize("name", EMITTED)
def test_components_schema_describes_what_is_sent(name):
    schema = openapi_document()["components"]["schemas"][name]
    validator = _validator(name)
    for body in EMITTED[name]:
        validator.validate(body)
        assert set(body) == set(schema["properties"]) == set(schema["required"])  # every field, always sent


def test_components_schemas_come_from_the_models():
    schemas = openapi_document()["components"]["schemas"]
    assert schemas == component_schemas()
    for model in objects.RESPONSE_OBJECTS:
        assert list(schemas[model.__name__]["properties"]) == list(model.model_fields)
    assert schemas["Batch"]["properties"]["status"]["enum"] == list(JOB_STATUSES)


def test_a_document_bad_body_is_rejected_by_the_schema():
    """The schemas are strict enough to catch a drifted serializer."""
    body = EMITTED["Batch"][0] | {"unexpected": 1}
    assert not _validator("Batch").is_valid(body)
    body = {k: v for k, v in EMITTED["Job"][0].items() if k != "progress"}
    assert not _validator("Job").is_valid(body)
