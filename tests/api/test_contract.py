"""The published contract and the server agree: what /openapi.json declares for parameters and forms is
what the handlers validate with (api.inputs), each rejection the document implies is a 400 naming the
parameter, 405s say which methods there are, and a valid key stays valid whatever the path id."""

import io
import json
import re

import pytest

from api import inputs
from api.objects import BatchCreate
from tests.helpers import MODEL, chat_line, jsonl

FORMS = {("/v1/jobs", "post"): inputs.JobUpload, ("/v1/files", "post"): inputs.FileUpload}
QUERIES = {
    ("/v1/jobs", "get"): inputs.JobListQuery,
    ("/v1/batches", "get"): inputs.BatchListQuery,
    ("/v1/files", "get"): inputs.FileListQuery,
    ("/v1/jobs/{job_id}/results", "get"): inputs.ResultsQuery,
}


@pytest.fixture
def spec(client):
    return client.get("/openapi.json").get_json()


def test_parameters_and_forms_are_the_declarations_the_handlers_use(spec):
    for (path, method), model in QUERIES.items():
        declared = [p["name"] for p in spec["paths"][path][method]["parameters"] if p["in"] == "query"]
        assert declared == list(model.model_fields), path
    for (path, method), model in FORMS.items():
        form = spec["paths"][path][method]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert set(form["properties"]) == set(model.model_fields), path
        assert set(form["required"]) == {n for n, f in model.model_fields.items() if f.is_required()}
    assert set(spec["components"]["schemas"]["BatchCreate"]["properties"]) == set(BatchCreate.model_fields)


def test_the_document_speaks_json_schema_not_pydantic(spec):
    text = json.dumps([spec["paths"], spec["components"]])
    for keyword in ("ge", "le", "gt", "lt", "patternProperties", "title"):
        assert f'"{keyword}":' not in text, keyword
    assert '"default": null' not in text  # an absent field is absent, not null


def test_model_lists_the_models_served(spec):
    form = spec["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["model"]["enum"] == [MODEL]


def test_links_lead_from_each_create_to_what_it_made(spec):
    operation_ids = {op["operationId"] for ops in spec["paths"].values() for op in ops.values()}
    links = {
        path: op["responses"][code]["links"]
        for path, code in (("/v1/jobs", "201"), ("/v1/batches", "200"), ("/v1/files", "200"))
        for op in [spec["paths"][path]["post"]]
    }
    assert {"getJob", "cancelJob", "getJobResults", "getJobErrors"} <= set(links["/v1/jobs"])
    assert {"getBatch", "cancelBatch"} <= set(links["/v1/batches"])
    assert links["/v1/files"]["createBatch"]["requestBody"] == {"input_file_id": "$response.body#/id"}
    for found in links.values():
        assert {link["operationId"] for link in found.values()} <= operation_ids


def test_405_says_which_methods_the_resource_has(client, spec):
    for path, ops in spec["paths"].items():
        url = re.sub(r"{[^}]+}", "batch_x", path)
        r = client.open(url, method="TRACE")
        assert r.status_code == 405 and r.get_json()["error"]["code"] == "method_not_allowed", path
        allowed = {m.strip() for m in r.headers["Allow"].split(",")}
        assert {m.upper() for m in ops} <= allowed, (path, allowed)


@pytest.mark.parametrize(
    "url, param",
    [
        ("/v1/jobs?status=", "status"),  # not one of the statuses: empty is no exception
        ("/v1/jobs?status=done", "status"),
        ("/v1/jobs?limit=1_0", "limit"),  # int() would take it; the document's integer does not
        ("/v1/jobs?limit=+5", "limit"),
        ("/v1/jobs?limit=0", "limit"),
        ("/v1/jobs?after=", "after"),
        ("/v1/files?order=", "order"),
        ("/v1/files?purpose=a%00b", "purpose"),
        ("/v1/batches?limit=101", "limit"),
        ("/v1/jobs/batch_x/results?format=csv", "format"),
    ],
)
def test_what_the_document_rejects_is_a_400_naming_it(client, url, param):
    r = client.get(url)
    assert r.status_code == 400, (url, r.get_json())
    assert r.get_json()["error"]["param"] == param


def test_integers_may_be_written_as_integral_floats(client):
    assert client.get("/v1/jobs?limit=5.0").status_code == 200  # JSON Schema: 5.0 is an integer
    assert client.get("/v1/jobs?limit=5.5").status_code == 400


@pytest.mark.parametrize("path_id", ["..", "a b", "é", "%2e", "batch_x\x01", "'\"<>", "x" * 128, "\u202e"])
def test_a_valid_key_stays_valid_whatever_the_path_id(client, path_id):
    """Schemathesis reported 401s on path-id operations although the key was valid: they were its own
    probes without a key (coverage phase), counted against operations that, without links, answered
    every other request 404. Authentication never depends on the path."""
    from urllib.parse import quote

    for method, url in (("GET", "/v1/jobs/{}"), ("POST", "/v1/batches/{}/cancel"), ("GET", "/v1/jobs/{}/results")):
        r = client.open(url.format(quote(path_id, safe="")), method=method)
        assert r.status_code == 404, (path_id, url, r.get_json())


def test_a_nul_in_a_path_id_is_a_400(client):
    assert client.get("/v1/jobs/a%00b").status_code == 400


def test_a_multipart_job_takes_its_options_from_the_form(client):
    body = jsonl([chat_line("a", "hi")])
    data = {"file": (io.BytesIO(body), "in.jsonl")}
    r = client.post(f"/v1/jobs?model={MODEL}", data=data, content_type="multipart/form-data")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "model"  # the form's is required
    data = {"file": (io.BytesIO(body), "in.jsonl"), "model": MODEL, "defaults": json.dumps({"max_tokens": 2})}
    r = client.post("/v1/jobs?priority=500", data=data, content_type="multipart/form-data")
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "priority"  # checked though unused
    data = {"file": (io.BytesIO(body), "in.jsonl"), "model": MODEL, "defaults": "", "priority": "1"}
    assert client.post("/v1/jobs", data=data, content_type="multipart/form-data").status_code == 400
    for unknown in ("", "prority"):  # a part with no name, a misspelt option: refused, not dropped
        data = {"file": (io.BytesIO(body), "in.jsonl"), "model": MODEL, unknown: "5"}
        r = client.post("/v1/jobs", data=data, content_type="multipart/form-data")
        assert r.status_code == 400 and f"unknown multipart fields: [{unknown!r}]" in r.get_json()["error"]["message"]
    data = {"file": (io.BytesIO(body), "in.jsonl"), "model": MODEL, "priority": "-3.0"}
    r = client.post("/v1/jobs", data=data, content_type="multipart/form-data")
    assert r.status_code == 201 and r.get_json()["priority"] == -3
    client.post(f"/v1/jobs/{r.get_json()['id']}/cancel")


def test_expires_after_as_a_json_part(client):
    def upload(**fields):
        data = {"file": (io.BytesIO(b"{}\n"), "in.jsonl"), "purpose": "batch", **fields}
        return client.post("/v1/files", data=data, content_type="multipart/form-data")

    made = upload(expires_after=json.dumps({"anchor": "created_at", "seconds": 7200.0}))
    assert made.status_code == 200 and made.get_json()["expires_at"] - made.get_json()["created_at"] == 7200
    for bad in ("null", '{"anchor": "created_at", "seconds": 7200, "extra": 1}', '{"anchor": "created_at"}', ""):
        r = upload(expires_after=bad)
        assert r.status_code == 400 and r.get_json()["error"]["param"].startswith("expires_after"), bad


def test_batch_body_is_held_to_its_declaration(client):
    file_id = client.post(
        "/v1/files",
        data={"file": (io.BytesIO(b"{}\n"), "in.jsonl"), "purpose": "batch"},
        content_type="multipart/form-data",
    ).get_json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    for bad in (
        {"metadata": ""},
        {"on_invalid_lines": ""},
        {"priority": "5"},
        {"input_file_id": ""},
        {"output_expires_after": {"anchor": "created_at", "seconds": "7200"}},
    ):
        r = client.post("/v1/batches", json={**body, **bad})
        assert r.status_code == 400 and r.get_json()["error"]["param"].startswith(next(iter(bad))), bad
    made = client.post("/v1/batches", json={**body, "priority": 7.0, "metadata": None})
    assert made.status_code == 200, made.get_json()
    client.post(f"/v1/batches/{made.get_json()['id']}/cancel")


@pytest.mark.parametrize(
    "value, valid",
    [
        (None, True),
        (True, True),
        (3, True),
        (1.5, True),
        ("a", True),
        ([1, [None]], True),
        ({"a": {"b": ["c"]}}, True),
        ("a\x00", False),
        (["\x00"], False),
        ({"k\x00": 1}, False),
        ({"a": {"b": "\x00"}}, False),
    ],
)
def test_json_values_are_what_the_document_says(spec, value, valid):
    """defaults' values: the document's one-schema JsonValue and pydantic's union agree."""
    from jsonschema import Draft202012Validator
    from pydantic import TypeAdapter, ValidationError

    validator = Draft202012Validator({"$ref": "#/components/schemas/JsonValue", "components": spec["components"]})
    assert validator.is_valid(value) is valid
    try:
        TypeAdapter(inputs.JsonValue).validate_python(value, strict=True)
        assert valid
    except ValidationError:
        assert not valid
