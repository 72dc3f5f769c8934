"""`jobs`, `cancel`, `errors`, `status`, `wait`, `quote` and `submit --wait` against the production shape (PostgreSQL,
Redis, a real worker, the API over HTTP), their exit statuses, and `doctor` on the same configuration."""

from __future__ import annotations

import json

import pytest

from pagedbatch.cli import main
from tests.helpers import MODEL, chat_line, free_port, jsonl, long_line

BAD = {"custom_id": "bad-1", "method": "POST", "url": "/v1/nothing", "body": {}}


def fields(table: str) -> dict[str, str]:
    """A job's table, as {name: value} (an error line per failed line: the last one kept)."""
    return dict(line.split(None, 1) for line in table.splitlines() if line.strip())


@pytest.fixture
def cli(live_url, platform, monkeypatch, capsys):
    """main(argv) -> (exit status, stdout, stderr) with the tenant's key and the live API."""
    monkeypatch.setenv("PAGEDBATCH_API_KEY", platform.api_key)
    monkeypatch.setenv("PAGEDBATCH_API_URL", live_url)

    def run(*argv: str):
        capsys.readouterr()
        status = main(list(argv))
        out = capsys.readouterr()
        return status, out.out, out.err

    return run


def test_finished_job_verbs_and_exit_statuses(worker, cli, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(f"c{i}", f"hi {i}") for i in range(3)] + [BAD]))
    status, out, err = cli("submit", str(src), "--model", MODEL, "--wait", "-q")
    job_id = out.splitlines()[0]
    assert status == 0 and job_id.startswith("batch_"), err
    table = fields(err)  # the person's table
    assert table["status"] == "completed" and table["lines"].startswith("4 total: 3 completed, 1 failed")
    assert cli("submit", str(src), "--model", MODEL, "--wait", "--strict", "-q")[0] == 3

    status, out, _ = cli("wait", job_id, "-q")
    assert status == 0 and out.splitlines()[0].split() == ["id", job_id]
    assert cli("wait", job_id, "-q", "--strict")[0] == 3
    status, out, _ = cli("status", job_id, "--json")
    job = json.loads(out)
    assert status == 0 and job["request_counts"]["invalid"] == 1
    assert job["plan"]["prompt_tokens"] == job["usage"]["prompt_tokens"] and job["estimated_completion_at"] is None

    status, out, _ = cli("quote", str(src), "--model", MODEL, "-q", "--json")  # the same file, priced, not run
    quote = json.loads(out)
    assert status == 0 and (quote["lines"], quote["invalid_lines"]) == (3, 1)
    assert quote["prompt_tokens"] == job["usage"]["prompt_tokens"] and quote["workers"] >= 1
    status, out, _ = cli("quote", str(src), "--model", MODEL, "-q")
    assert status == 0 and fields(out)["lines"] == "3 valid, 1 invalid, in 1 shards"

    status, out, _ = cli("jobs")
    header, *rows = out.splitlines()
    assert status == 0 and header.split() == [
        "ID",
        "STATUS",
        "MODEL",
        "PROGRESS",
        "LINES",
        "COMPLETED",
        "FAILED",
        "CREATED",
    ]
    row = next(r.split() for r in rows if r.startswith(job_id))
    assert row[1:7] == ["completed", MODEL, "100%", "4", "3", "1"]
    status, out, _ = cli("jobs", "--json", "--limit", "100")
    listed = {job["id"]: job for job in json.loads(out)["data"]}
    assert status == 0 and listed[job_id]["request_counts"]["completed"] == 3

    status, out, _ = cli("errors", job_id)
    assert status == 0 and out.splitlines()[1].split()[:2] == ["bad-1", "invalid_url"]
    status, out, _ = cli("errors", job_id, "--json")
    (line,) = [json.loads(s) for s in out.splitlines()]
    assert status == 0 and line["custom_id"] == "bad-1"

    status, _, err = cli("cancel", job_id)
    assert status == 2 and err.startswith("pagedbatch: the API answered 409: ") and err.count("\n") == 1


def test_cancel_then_wait_exits_4(cli, tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_bytes(jsonl([long_line(f"l{i}", max_tokens=64) for i in range(32)]))
    status, out, _ = cli("submit", str(src), "--model", MODEL, "-q", "--json")
    job_id, job = out.splitlines()[0], json.loads("".join(out.splitlines(keepends=True)[1:]))
    assert status == 0 and job["id"] == job_id
    status, out, _ = cli("cancel", job_id, "--json")
    assert status == 0 and json.loads(out)["status"] in ("cancelling", "cancelled")
    status, out, _ = cli("wait", job_id, "-q", "--timeout", "60")
    assert status == 4 and fields(out)["status"] == "cancelled"
    assert cli("cancel", job_id)[0] == 0  # cancelling a cancelled job changes nothing
    status, out, _ = cli("jobs", "--status", "cancelled", "--json")
    assert job_id in [j["id"] for j in json.loads(out)["data"]]


def test_unknown_jobs_bad_keys_and_refused_requests_exit_2(cli, tmp_path):
    for argv in (
        ["status", "batch_nope"],
        ["cancel", "batch_nope"],
        ["errors", "batch_nope"],
        ["wait", "batch_nope"],
        ["download", "batch_nope", "-o", str(tmp_path / "r.parquet")],
    ):
        status, out, err = cli(*argv)
        assert (status, out) == (2, "") and err.startswith("pagedbatch: the API answered 404: "), (argv, err)
        assert err.count("\n") == 1
    status, _, err = cli("jobs", "--api-key", "pb-wrong")
    assert status == 2 and "the API answered 401" in err
    status, _, err = cli("jobs", "--limit", "0")
    assert status == 2 and "the API answered 400: limit" in err and err.count("\n") == 1, err
    status, _, err = cli("submit", str(tmp_path / "r.parquet"), "--model", MODEL)
    assert status == 2 and err == f"pagedbatch: no such file: {tmp_path / 'r.parquet'}\n"


def test_admin_commands_on_the_database(platform, cli):
    url = platform.settings.database_url
    status, out, _ = cli("keys", "list", "--database-url", url, "--json")
    assert status == 0 and {k["tenant"] for k in json.loads(out)} >= {"default", "other"}
    status, _, err = cli("keys", "revoke", "key_nope", "--database-url", url)
    assert status == 2 and err.startswith("pagedbatch: no key key_nope")


def _doctor(cli, monkeypatch, settings, *argv):
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    status, out, err = cli("doctor", *argv)
    return status, out, err


def test_doctor_on_the_production_shape(platform, cli, monkeypatch, live_url, tmp_path):
    status, out, err = _doctor(cli, monkeypatch, platform.settings, "--json", "--url", live_url)
    report = json.loads(out)
    checks = {c["name"]: c for c in report["checks"]}
    assert status == 0 and report["ok"] and err == "", out
    assert checks["PostgreSQL"]["state"] == "ok" and "reachable at" in checks["PostgreSQL"]["detail"]
    assert checks["Redis"]["state"] == "ok" and checks[f"model {MODEL}"]["state"] == "ok"
    assert "Qwen3ForCausalLM (supported)" in checks[f"model {MODEL}"]["detail"]
    assert checks["device"]["state"] == "ok" and checks["API"]["state"] == "ok"
    assert checks["native kernels"]["state"] in ("ok", "note") and checks["storage"]["state"] == "ok"

    # the person's lines: one a check
    status, out, _ = _doctor(cli, monkeypatch, platform.settings, "--url", live_url)
    assert status == 0 and [line.split()[0] for line in out.splitlines()] == ["ok"] * len(checks)

    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    down = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.setenv("PAGEDBATCH_BROKER_URL", down)
    broken = platform.settings.__class__(**{**platform.settings.__dict__, "broker_url": down})
    status, out, err = _doctor(cli, monkeypatch, broken, "--model", f"gpt2={unsupported}", "--min-free-gib", "1e9")
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("MISSING")}
    assert status == 1 and err == "pagedbatch: missing: Redis, storage, model gpt2\n", out
    assert f"cannot reach {down}" in lines["Redis"] and "GPT2LMHeadModel is not supported" in lines["model"]
