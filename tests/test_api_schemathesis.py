"""Schemathesis against /openapi.json, in process (WSGI): no 5xx for any generated request, valid or
not, and every response is documented (status code, content type, body schema).
Jobs created here stay queued: no worker runs."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from api.openapi import openapi_document

pytestmark = pytest.mark.slow  # hundreds of generated requests

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 20}


def _negatable(op: dict) -> bool:
    """Whether some input can violate the document: a body, or a parameter with a type or bounds.
    (A path id is any string, so an operation with only that has no invalid input.)"""
    return "requestBody" in op or any(p.get("schema", {}) != {"type": "string"} for p in op.get("parameters", []))


CASES = [
    pytest.param(f"{method.upper()} {path}", mode, id=f"{method.upper()} {path} {mode.value}")
    for path, ops in openapi_document()["paths"].items()
    for method, op in ops.items()
    for mode in MAX_EXAMPLES
    if mode is GenerationMode.POSITIVE or _negatable(op)
]


def harness_auth_headers(harness) -> dict:
    """The default tenant's Authorization header once the harness has API keys; none before."""
    maker = getattr(harness, "auth_headers", None)
    if callable(maker):
        return dict(maker())
    keys = getattr(harness, "api_keys", None) or getattr(harness, "keys", None)
    key = keys.get("default") if isinstance(keys, dict) else getattr(harness, "api_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def api_schema(platform):
    """The document as the app serves it, bound to the app (requests go through WSGI)."""
    return schemathesis.openapi.from_wsgi("/openapi.json", platform.app())


@pytest.mark.parametrize("label, mode", CASES)
def test_operation_conforms_to_the_document(api_schema, platform, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is in openapi_document() but not in the served /openapi.json"
    headers = harness_auth_headers(platform)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES[mode], deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        case.call_and_validate(headers=headers, checks=CHECKS)

    run()
