"""A job's `priority` and a tenant's fair-share `weight` (issue 12): stored (migration 0008), shown, checked
with clear 400s, set by the admin CLI, and carried with each shard's claim to the worker's FairShare."""

from __future__ import annotations

import io
import uuid

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from pagedbatch.cli import main
from store import keys
from store.db import session_scope
from store.lifecycle.shards import claim_shard
from store.models import Tenant
from tests.helpers import MODEL, completion_line, jsonl, validated


def _tenant(tag: str) -> str:
    return f"prio-{tag}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def unserved(platform):
    """An app of a fresh tenant whose shards go to a queue no worker listens to (the test claims them)."""
    app = platform.app(queue_prefix="pbtest-noprio-" + platform.settings.queue_prefix, default_tenant=_tenant("api"))
    return app, app.test_client(), app.extensions["pagedbatch"].settings


def _create(client, **fields):
    data = {
        "file": (io.BytesIO(jsonl([completion_line(f"r{i}", "hi") for i in range(3)])), "in.jsonl"),
        "model": MODEL,
        **fields,
    }
    return client.post("/v1/jobs", data=data, content_type="multipart/form-data")


def test_a_jobs_priority_is_stored_shown_and_carried_with_its_shards_and_tenant_weight(unserved):
    app, client, settings = unserved
    keys.set_tenant_limits(
        settings, settings.default_tenant, max_active_jobs=None, max_queued_requests=None, weight=2.5
    )
    r = _create(client, priority="-7")
    assert r.status_code == 201, r.get_json()
    assert r.get_json()["priority"] == -7
    job = validated(client, r)
    assert job["priority"] == -7 and client.get("/v1/jobs").get_json()["data"][0]["priority"] == -7
    claim = claim_shard(settings, f"{job['id']}.00000", "test")
    assert (claim.tenant, claim.tenant_weight, claim.priority) == (settings.default_tenant, 2.5, -7)
    client.post(f"/v1/jobs/{job['id']}/cancel")

    plain = validated(
        client,
        client.post(
            f"/v1/jobs?model={MODEL}&priority=3",
            data=jsonl([completion_line("a", "x")]),
            content_type="application/x-ndjson",
        ),
    )
    assert plain["priority"] == 3
    client.post(f"/v1/jobs/{plain['id']}/cancel")
    default = validated(client, _create(client))
    assert default["priority"] == 0
    client.post(f"/v1/jobs/{default['id']}/cancel")


@pytest.mark.parametrize(
    "value, message",
    [
        ("high", "priority must be an integer, got 'high'"),
        ("1.5", "priority must be an integer"),
        ("101", "priority must be between -100 and 100 (a lower value is served first), got 101"),
        ("-101", "priority must be between -100 and 100"),
    ],
)
def test_a_bad_priority_is_a_400_naming_it(unserved, value, message):
    _, client, _ = unserved
    r = _create(client, priority=value)
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["param"] == "priority" and message in error["message"]


def test_batches_take_priority_as_an_extension_field(unserved):
    _, client, _ = unserved
    upload = {"file": (io.BytesIO(jsonl([completion_line("a", "x")])), "in.jsonl"), "purpose": "batch"}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    for bad, message in ((1.5, "must be an integer"), (True, "must be an integer"), (500, "between -100 and 100")):
        r = client.post("/v1/batches", json={**body, "priority": bad})
        assert r.status_code == 400 and r.get_json()["error"]["param"] == "priority"
        assert message in r.get_json()["error"]["message"]
    batch = client.post("/v1/batches", json={**body, "priority": 42}).get_json()
    assert "priority" not in batch  # OpenAI's Batch object stays OpenAI's; the native job shows it
    assert client.get(f"/v1/jobs/{batch['id']}").get_json()["priority"] == 42
    client.post(f"/v1/batches/{batch['id']}/cancel")


def test_tenant_weight_cli_and_database_bounds(platform, capsys):
    url, tenant = platform.settings.database_url, _tenant("cli")
    assert main(["tenants", "set", tenant, "--weight", "3", "--database-url", url]) == 0
    assert "weight 3" in capsys.readouterr().out
    assert main(["tenants", "set", tenant, "--max-files", "4", "--database-url", url]) == 0  # weight kept
    assert "max files 4, max file bytes default, weight 3" in capsys.readouterr().out
    assert main(["tenants", "list", "--database-url", url]) == 0
    assert (
        f"{tenant}\tmax_active_jobs=default\tmax_queued_requests=default\tmax_files=4\t"
        "max_file_bytes=default\tweight=3" in capsys.readouterr().out
    )
    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(SystemExit):
            main(["tenants", "set", tenant, "--weight", bad, "--database-url", url])
        assert "a weight is a positive number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a tenant's weight is a positive number"):
        keys.set_tenant_limits(platform.settings, tenant, max_active_jobs=None, max_queued_requests=None, weight=0)
    new = _tenant("new")
    keys.set_tenant_limits(platform.settings, new, max_active_jobs=None, max_queued_requests=None)
    assert {t.name: t.weight for t in keys.list_tenants(platform.settings)}[new] == 1.0  # the default
    with pytest.raises(IntegrityError, match="ck_tenants_weight"), session_scope(url) as s:  # the database's bound
        s.execute(insert(Tenant).values(name=_tenant("zero"), weight=0))


def test_the_openapi_document_shows_priority(client):
    spec = client.get("/openapi.json").get_json()
    job = spec["components"]["schemas"]["Job"]
    assert (job["properties"]["priority"]["minimum"], job["properties"]["priority"]["maximum"]) == (-100, 100)
    assert "priority" in job["required"]
    create = spec["paths"]["/v1/jobs"]["post"]
    form = create["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert (form["priority"]["minimum"], form["priority"]["maximum"]) == (-100, 100)
    assert "query parameters" in create["description"]  # a raw JSONL body takes the options there
    assert spec["components"]["schemas"]["BatchCreate"]["properties"]["priority"]["default"] == 0


def test_the_official_client_sends_priority_with_extra_body(platform, live_url):
    import openai

    client = openai.OpenAI(base_url=live_url + "/v1", api_key=platform.api_key, max_retries=0)
    created = client.files.create(file=("in.jsonl", jsonl([completion_line("a", "hi")])), purpose="batch")
    batch = client.batches.create(
        input_file_id=created.id, endpoint="/v1/completions", completion_window="24h", extra_body={"priority": -5}
    )
    assert isinstance(batch, openai.types.Batch) and batch.status in ("validating", "in_progress")
    with pytest.raises(openai.BadRequestError, match="priority must be between"):
        client.batches.create(
            input_file_id=created.id, endpoint="/v1/completions", completion_window="24h", extra_body={"priority": 1000}
        )
    job = client.get(f"/jobs/{batch.id}", cast_to=object)
    assert job["priority"] == -5
    client.batches.cancel(batch.id)
