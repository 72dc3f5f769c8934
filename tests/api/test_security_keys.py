"""Tenants and API keys: keys stored hashed, every route authenticated, tenants isolated, per-tenant limits."""

import hashlib
import io
import json
import os
import re
import secrets
import stat
import string
import subprocess
import sys
import threading
from collections import Counter

import pytest
from flask.testing import FlaskClient
from sqlalchemy import create_engine, text

from pagedbatch.cli import build_parser, main
from pagedbatch.commands.client_commands import api_key
from store import ids, keys
from store.db import normalize_url
from tests.helpers import MODEL, REPO, chat_line, jsonl, validated

PUBLIC = {"/healthz", "/readyz", "/openapi.json", "/metrics"}


def _tenant(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


def _rows(platform, sql: str, **params):
    engine = create_engine(normalize_url(platform.settings.database_url))
    try:
        with engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def _bare(platform, **overrides):
    """A test client that sends no Authorization header."""
    return FlaskClient(platform.app(**overrides))


def _post_job(client, lines, model=MODEL):
    return client.post(f"/v1/jobs?model={model}", data=jsonl(lines), content_type="application/x-ndjson")


def _assert_401(r):
    assert r.status_code == 401, (r.status_code, r.data)
    error = r.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error" and error["code"] in ("missing_api_key", "invalid_api_key")
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


# ---- keys ---------------------------------------------------------------------------------------------


def test_create_list_revoke(platform):
    tenant = _tenant("keys")
    key, info = keys.create_key(platform.settings, tenant, name="ci")
    assert re.fullmatch(r"pb-[A-Za-z0-9_-]{40}", key)
    assert info.tenant == tenant and info.prefix == key[:10] and not info.revoked and info.id.startswith("key_")
    listed = keys.list_keys(platform.settings, tenant)
    assert [(k.id, k.prefix, k.name, k.revoked) for k in listed] == [(info.id, key[:10], "ci", False)]
    assert key not in repr(listed)

    client = platform.app().test_client()
    auth = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/jobs", headers=auth).status_code == 200
    revoked = keys.revoke_key(platform.settings, info.id)
    assert revoked.revoked and revoked.revoked_at is not None
    assert keys.list_keys(platform.settings, tenant)[0].revoked
    _assert_401(client.get("/v1/jobs", headers=auth))
    assert keys.revoke_key(platform.settings, info.id).revoked_at == revoked.revoked_at  # idempotent
    with pytest.raises(KeyError):
        keys.revoke_key(platform.settings, "key_doesnotexist")


def test_keys_are_stored_only_as_hashes(platform):
    key, info = keys.create_key(platform.settings, _tenant("hash"))
    (row,) = _rows(platform, "select * from api_keys where id = :id", id=info.id)
    assert row["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    secret_part = key[10:]  # all but the shown prefix
    dump = json.dumps(_rows(platform, "select * from api_keys"), default=str)
    dump += json.dumps(_rows(platform, "select * from tenants"), default=str)
    assert key not in dump and secret_part not in dump and secret_part[:12] not in dump


def test_keys_cli_commands(platform, capsys):
    url = platform.settings.database_url
    tenant = _tenant("cli")
    assert main(["keys", "create", "--tenant", tenant, "--name", "laptop", "--database-url", url]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert re.fullmatch(r"pb-[A-Za-z0-9_-]{40}", key) and "shown only this once" in out.err
    assert main(["keys", "list", "--tenant", tenant, "--database-url", url]) == 0
    table = capsys.readouterr().out
    assert key not in table and key[:10] in table and "laptop" in table
    assert table.splitlines()[0].split()[:5] == ["ID", "TENANT", "PREFIX", "CREATED", "REVOKED"]
    assert main(["keys", "list", "--tenant", tenant, "--json", "--database-url", url]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["tenant"] == tenant and listed["revoked_at"] is None and key not in json.dumps(listed)
    assert main(["keys", "revoke", listed["id"], "--database-url", url]) == 0
    assert main(["keys", "list", "--tenant", tenant, "--json", "--database-url", url]) == 0
    assert json.loads(capsys.readouterr().out)[0]["revoked_at"] is not None
    assert main(["keys", "revoke", "key_nope", "--database-url", url]) == 2  # an unknown id: an input error

    assert main(["tenants", "set", tenant, "--max-active-jobs", "3", "--database-url", url]) == 0
    assert "max active jobs 3" in capsys.readouterr().out
    assert main(["tenants", "list", "--database-url", url]) == 0
    assert f"{tenant}\tmax_active_jobs=3\tmax_queued_requests=default" in capsys.readouterr().out


def test_keys_command_in_a_subprocess(platform):
    tenant = _tenant("proc")
    env = {**os.environ, "PAGEDBATCH_DATABASE_URL": platform.settings.database_url}
    done = subprocess.run(
        [sys.executable, "-m", "pagedbatch", "keys", "create", "--tenant", tenant],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()
    assert re.fullmatch(r"pb-[A-Za-z0-9_-]{40}", key) and key not in done.stderr
    r = platform.app().test_client().get("/v1/files", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.get_json()["data"] == []


# ---- authentication on every route -----------------------------------------------------------------


def _every_route(app):
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", "batch_x", rule.rule)
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            yield method, path


def test_every_route_but_health_needs_a_valid_key(platform):
    bare = _bare(platform)
    _, info = keys.create_key(platform.settings, _tenant("revoked"))
    revoked_key, revoked_info = keys.create_key(platform.settings, _tenant("revoked"))
    keys.revoke_key(platform.settings, revoked_info.id)
    routes = list(_every_route(bare.application))
    assert {p for _, p in routes} >= PUBLIC | {"/v1/jobs", "/v1/batches", "/v1/files", "/v1/models"}
    for method, path in routes:
        if path in PUBLIC:
            assert bare.open(path, method=method).status_code == 200, path
            continue
        if path.startswith("/ui/"):  # the dashboard signs in with a session cookie, never the key header
            for headers in ({}, platform.auth()):
                r = bare.open(path, method=method, headers=headers)
                if (method, path) == ("GET", "/ui/login"):
                    assert r.status_code == 200
                elif r.status_code == 302:
                    assert r.headers["Location"].endswith("/ui/login"), (method, path)
                else:  # JSON and actions: 401; sign-in and sign-out without the form's CSRF token: 400
                    assert r.status_code in (400, 401), (method, path, r.status_code)
            continue
        for headers in (
            {},
            {"Authorization": f"Bearer {revoked_key}"},
            {"Authorization": "Bearer pb-" + "x" * 40},
            {"Authorization": "Bearer "},
            {"Authorization": platform.api_key},  # no scheme
            {"Authorization": f"Basic {platform.api_key}"},
        ):
            _assert_401(bare.open(path, method=method, headers=headers))
    # unknown routes too, so that a key is needed even to learn which routes exist
    _assert_401(bare.get("/v1/nope"))
    assert bare.get("/v1/nope", headers=platform.auth()).status_code == 404
    missing = bare.get("/v1/jobs").get_json()["error"]
    assert missing["code"] == "missing_api_key"
    unknown = bare.get("/v1/jobs", headers={"Authorization": "Bearer pb-" + "x" * 40}).get_json()["error"]
    revoked = bare.get("/v1/jobs", headers={"Authorization": f"Bearer {revoked_key}"}).get_json()["error"]
    assert unknown == revoked and unknown["code"] == "invalid_api_key"  # a revoked key is not disclosed


def test_openapi_declares_bearer_auth(platform):
    spec = _bare(platform).get("/openapi.json").get_json()
    (scheme,) = spec["components"]["securitySchemes"].values()
    assert scheme["type"] == "http" and scheme["scheme"] == "bearer"
    assert spec["security"] and spec["paths"]["/healthz"]["get"]["security"] == []
    assert spec["paths"]["/openapi.json"]["get"]["security"] == []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if path not in PUBLIC:
                assert "401" in op["responses"], (path, method)
    assert "Retry-After" in spec["paths"]["/v1/jobs"]["post"]["responses"]["429"]["headers"]
    assert "429" in spec["paths"]["/v1/batches"]["post"]["responses"]


def test_client_sends_the_key(platform):
    from pagedbatch.client import ApiError, Client

    url = platform.start_server()
    with pytest.raises(ApiError) as exc:
        Client(url).job("batch_x")
    assert exc.value.status == 401
    with pytest.raises(ApiError) as exc:
        Client(url, api_key=platform.api_key).job("batch_x")
    assert exc.value.status == 404


# ---- tenant isolation ----------------------------------------------------------------------------------


def _same_as_missing(their, mine_missing, their_id: str, missing_id: str) -> None:
    assert their.status_code == mine_missing.status_code == 404
    assert their.data.replace(their_id.encode(), missing_id.encode()) == mine_missing.data
    assert their.headers["Content-Type"] == mine_missing.headers["Content-Type"]


def test_another_tenants_ids_answer_exactly_like_missing_ones(platform):
    a, b = _tenant("a"), _tenant("b")
    mine = _noworker(platform, a)  # its running job stays in progress
    theirs = platform.app(default_tenant=b).test_client()
    failed = mine.post(f"/v1/jobs?model={MODEL}", data=b"bad\n", content_type="application/x-ndjson").get_json()
    running = _post_job(mine, [chat_line("r", "hi")]).get_json()
    for job in (failed, running):
        jid, fid = job["id"], job["input_file_id"]
        fake_job = ids.job_id()
        fake_file = ids.file_id()
        for method, path in (
            ("GET", "/v1/jobs/{}"),
            ("POST", "/v1/jobs/{}/cancel"),
            ("GET", "/v1/jobs/{}/results"),
            ("GET", "/v1/jobs/{}/results?format=jsonl"),
            ("GET", "/v1/jobs/{}/errors"),
            ("GET", "/v1/batches/{}"),
            ("POST", "/v1/batches/{}/cancel"),
            ("GET", "/v1/jobs?after={}"),
            ("GET", "/v1/batches?after={}"),
        ):
            _same_as_missing(
                theirs.open(path.format(jid), method=method),
                theirs.open(path.format(fake_job), method=method),
                jid,
                fake_job,
            )
        for path in ("/v1/files/{}", "/v1/files/{}/content", "/v1/files?after={}"):
            _same_as_missing(theirs.get(path.format(fid)), theirs.get(path.format(fake_file)), fid, fake_file)
        batch = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
        _same_as_missing(
            theirs.post("/v1/batches", json={**batch, "input_file_id": fid}),
            theirs.post("/v1/batches", json={**batch, "input_file_id": fake_file}),
            fid,
            fake_file,
        )
    # nothing was cancelled by the other tenant, and the owner still sees everything
    assert mine.get(f"/v1/jobs/{running['id']}").get_json()["status"] == "in_progress"
    assert mine.get(f"/v1/jobs/{failed['id']}/errors").status_code == 200
    assert mine.get(f"/v1/files/{failed['input_file_id']}/content").data == b"bad\n"


def test_lists_show_only_the_tenants_own_objects(platform):
    a, b = _tenant("list-a"), _tenant("list-b")
    mine = _noworker(platform, a)  # no output files appear while the lists are compared
    theirs = platform.app(default_tenant=b).test_client()
    job = _post_job(mine, [chat_line("x", "hi")]).get_json()
    upload = {"file": (io.BytesIO(jsonl([chat_line("y", "hi")])), "in.jsonl"), "purpose": "batch"}
    file = mine.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()
    batch = mine.post(
        "/v1/batches",
        json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).get_json()
    for path in ("/v1/jobs", "/v1/batches", "/v1/files", "/v1/jobs?status=in_progress"):
        assert theirs.get(path).get_json()["data"] == [], path
    assert {j["id"] for j in mine.get("/v1/jobs").get_json()["data"]} == {job["id"], batch["id"]}
    assert {j["id"] for j in mine.get("/v1/batches").get_json()["data"]} == {job["id"], batch["id"]}
    assert {f["id"] for f in mine.get("/v1/files").get_json()["data"]} == {job["input_file_id"], file["id"]}


# ---- limits ------------------------------------------------------------------------------------------------


def _assert_429(r, retry_after: int = 30):
    assert r.status_code == 429, (r.status_code, r.data)
    error = r.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert r.headers["Retry-After"] == str(retry_after)
    return error["message"]


def _noworker(platform, tenant, **overrides):
    """A client of `tenant` whose jobs go to queues nobody serves, so they stay active."""
    queue = f"pbtest-noworker-{secrets.token_hex(3)}"
    return platform.app(default_tenant=tenant, queue_prefix=queue, **overrides).test_client()


def test_active_jobs_limit_answers_429_until_a_job_finishes(platform):
    tenant = _tenant("lim")
    keys.set_tenant_limits(platform.settings, tenant, max_active_jobs=2, max_queued_requests=None)
    client = _noworker(platform, tenant)
    # a job that fails validation at once is not active and does not count
    assert validated(client, _post_job(client, ["bad"]))["status"] == "failed"
    first = validated(client, _post_job(client, [chat_line("a", "x")]))
    assert _post_job(client, [chat_line("a", "x")]).status_code == 201
    message = _assert_429(_post_job(client, [chat_line("a", "x")]))
    assert "2 active batches" in message and "limit is 2" in message
    upload = {"file": (io.BytesIO(jsonl([chat_line("b", "y")])), "in.jsonl"), "purpose": "batch"}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    batch = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    _assert_429(client.post("/v1/batches", json=batch))
    # once a job has finished (here: cancelled before it ran) the tenant may submit again
    assert client.post(f"/v1/jobs/{first['id']}/cancel").get_json()["status"] == "cancelled"
    assert client.post("/v1/batches", json=batch).status_code == 200
    _assert_429(_post_job(client, [chat_line("a", "x")]))
    # other tenants are not affected
    assert _post_job(_noworker(platform, _tenant("free")), [chat_line("a", "x")]).status_code == 201


def test_queued_requests_limit(platform):
    tenant = _tenant("queued")
    keys.set_tenant_limits(platform.settings, tenant, max_active_jobs=0, max_queued_requests=10)
    client = _noworker(platform, tenant)
    assert _post_job(client, [chat_line(f"a{i}", "x") for i in range(8)]).status_code == 201
    message = _assert_429(_post_job(client, [chat_line(f"b{i}", "x") for i in range(3)]))
    assert "8 queued requests" in message and "adds 3" in message
    assert _post_job(client, [chat_line(f"c{i}", "x") for i in range(2)]).status_code == 201  # exactly 10
    _assert_429(_post_job(client, [chat_line("d", "x")]))


def test_limits_from_settings_and_environment(platform, monkeypatch):
    from store.settings import Settings

    monkeypatch.setenv("PAGEDBATCH_MAX_ACTIVE_JOBS_PER_TENANT", "7")
    monkeypatch.setenv("PAGEDBATCH_MAX_QUEUED_REQUESTS_PER_TENANT", "900")
    monkeypatch.setenv("PAGEDBATCH_LIMIT_RETRY_AFTER_S", "12")
    env = Settings.from_env()
    assert (env.max_active_jobs_per_tenant, env.max_queued_requests_per_tenant, env.limit_retry_after_s) == (
        7,
        900,
        12,
    )
    assert Settings.from_env().to_env()["PAGEDBATCH_MAX_ACTIVE_JOBS_PER_TENANT"] == "7"
    defaults = Settings()
    assert defaults.max_active_jobs_per_tenant > 0 and defaults.max_queued_requests_per_tenant > 0

    client = _noworker(platform, _tenant("settings"), max_active_jobs_per_tenant=1, limit_retry_after_s=12)
    assert _post_job(client, [chat_line("a", "x")]).status_code == 201
    _assert_429(_post_job(client, [chat_line("a", "x")]), retry_after=12)


def test_concurrent_submissions_cannot_both_take_the_last_place(platform):
    tenant = _tenant("race")
    keys.set_tenant_limits(platform.settings, tenant, max_active_jobs=1, max_queued_requests=None)
    clients = [_noworker(platform, tenant) for _ in range(4)]
    barrier = threading.Barrier(len(clients))
    codes = []

    def submit(client):
        barrier.wait()
        codes.append(_post_job(client, [chat_line("a", "x")]).status_code)

    threads = [threading.Thread(target=submit, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [201, 429, 429, 429]


# ---- ids ---------------------------------------------------------------------------------------------------


def test_ids_are_unguessable():
    alphabet = set(string.ascii_letters + string.digits + "-_")
    job_ids = [ids.job_id() for _ in range(3000)]
    assert len(set(job_ids)) == len(job_ids)
    suffixes = [j.removeprefix("batch_") for j in job_ids]
    assert all(len(s) == 24 and set(s) <= alphabet for s in suffixes)  # 24 * 6 bits = 144 bits
    # every position is spread over the whole alphabet (no counter, no timestamp prefix)
    for position in range(24):
        counts = Counter(s[position] for s in suffixes)
        assert len(counts) > 55 and max(counts.values()) < 3000 / 64 * 2.5, position
    # consecutive ids share no structure
    same = [sum(x == y for x, y in zip(a, b, strict=True)) for a, b in zip(suffixes, suffixes[1:], strict=False)]
    assert max(same) <= 5
    assert all(len(f) == 29 and f.startswith("file-") for f in (ids.file_id() for _ in range(100)))
    api_keys = {keys.new_key() for _ in range(1000)}
    assert len(api_keys) == 1000 and all(len(k) == 43 for k in api_keys)


def test_api_ids_are_not_sequential(platform):
    client = platform.app(default_tenant=_tenant("ids")).test_client()
    jobs = [
        client.post(
            "/v1/jobs", data=b"bad\n", content_type="application/x-ndjson", query_string={"model": MODEL}
        ).get_json()
        for _ in range(3)
    ]
    suffixes = [j["id"].removeprefix("batch_") for j in jobs]
    for a, b in zip(suffixes, suffixes[1:], strict=False):
        assert len(a) == 24 and a[:6] != b[:6] and sum(x == y for x, y in zip(a, b, strict=True)) <= 5


# ---- serve's local key ---------------------------------------------------------------------------------


def test_serve_creates_its_key_once_and_reuses_it(platform, tmp_path):
    home = tmp_path / "home"
    key, created = keys.ensure_local_key(platform.settings, home)
    path = keys.local_key_path(home)
    assert created and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.tenant_for_key(platform.settings, key) == platform.settings.default_tenant
    assert keys.ensure_local_key(platform.settings, home) == (key, False)  # a restart reuses it
    # a saved key that no longer works (revoked, or another database) is replaced
    (info,) = [k for k in keys.list_keys(platform.settings) if k.prefix == key[:10]]
    keys.revoke_key(platform.settings, info.id)
    new, created = keys.ensure_local_key(platform.settings, home)
    assert created and new != key and path.read_text().strip() == new


def test_client_commands_find_a_key(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    keys.local_key_path(home).write_text("pb-saved\n")
    monkeypatch.setenv("PAGEDBATCH_HOME", str(home))
    monkeypatch.delenv("PAGEDBATCH_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert api_key(parse(["status", "batch_x", "--url", "http://127.0.0.1:8000"])) == "pb-saved"
    assert api_key(parse(["status", "batch_x", "--url", "http://localhost:9"])) == "pb-saved"
    assert api_key(parse(["status", "batch_x", "--url", "https://batch.example.com"])) is None
    monkeypatch.setenv("PAGEDBATCH_API_KEY", "pb-env")
    assert api_key(parse(["status", "batch_x", "--url", "https://batch.example.com"])) == "pb-env"
    assert api_key(parse(["status", "batch_x", "--api-key", "pb-flag"])) == "pb-flag"
