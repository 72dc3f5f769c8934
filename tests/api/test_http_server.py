"""Behind real HTTP servers (Werkzeug's, as `serve` runs it, and gunicorn, as `pagedbatch api` runs it):
downloads of files with any name (RFC 6266), and the servers' own 400/414 answers as JSON."""

import http.client
import io
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
from werkzeug.http import parse_options_header

from api.server_errors import make_json_error_server
from store.db import session_scope
from store.models import File
from tests.helpers import MODEL, REPO, chat_line, free_port, jsonl, spawn


@pytest.fixture(scope="module")
def werkzeug_url(platform):
    server = make_json_error_server("127.0.0.1", 0, platform.app())  # what `serve` runs
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def gunicorn(platform):
    """`pagedbatch api` (gunicorn, one worker process): (its URL, the master's Popen)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedbatch", "api", "--host=127.0.0.1", f"--port={port}", "--workers=1"]
    cmd += ["--model", f"{MODEL}={platform.model_path}"]
    env = {**os.environ, **platform.settings.to_env()}
    proc = spawn(cmd, platform.tmp / "gunicorn.log", cwd=REPO, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/healthz", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError((platform.tmp / "gunicorn.log").read_text()[-3000:]) from None
            time.sleep(0.2)
    yield url, proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def gunicorn_url(gunicorn):
    return gunicorn[0]


@pytest.fixture(params=["werkzeug", "gunicorn"])
def server_url(request):
    return request.getfixturevalue(f"{request.param}_url")


def _get(url: str, path: str, key: str) -> http.client.HTTPResponse:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    return conn.getresponse()


SAFE_HEADER = re.compile(r"""attachment; filename="[ -~]*"(; filename\*=UTF-8''[A-Za-z0-9%._~-]+)?""")


@pytest.mark.parametrize(
    "name",
    ["€uro.jsonl", "日本語.jsonl", 'a"; filename=evil.sh; x=".jsonl', "back\\slash.jsonl", "plain.jsonl"],
)
def test_any_filename_downloads_with_a_safe_content_disposition(platform, server_url, name):
    client = platform.app().test_client()
    body = jsonl([chat_line("a", "hi")])
    form = {"file": (io.BytesIO(body), "x.jsonl"), "purpose": "batch"}
    upload = client.post("/v1/files", data=form, content_type="multipart/form-data")
    file = upload.get_json()
    with session_scope(platform.settings.database_url) as s:  # any name a client's multipart encoding can carry
        s.get(File, file["id"]).filename = name
    response = _get(server_url, f"/v1/files/{file['id']}/content", platform.api_key)
    assert response.status == 200
    assert response.read() == body
    header = response.getheader("Content-Disposition")
    assert SAFE_HEADER.fullmatch(header), header  # one filename, no injected parameter
    kind, params = parse_options_header(header)
    assert kind == "attachment" and params == {"filename": name}


def _raw(url: str, request: bytes) -> tuple[int, dict, bytes]:
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /v1/files?x=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"NOT A REQUEST LINE AT ALL\r\n\r\n", 400),
        (b"GET /v1/files HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    ],
)
def test_the_servers_own_errors_are_json(server_url, request_bytes, status):
    got, headers, body = _raw(server_url, request_bytes)
    assert got in ((status, 505) if b"9.9" in request_bytes else (status,))
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


def _wait_validated(url: str, key: str, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            job = json.loads(response.read())
        if job["status"] != "validating" or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def test_four_8mb_lines_at_once_keep_the_api_under_1gb(platform, gunicorn):
    url, master = gunicorn
    (worker,) = psutil.Process(master.pid).children()
    body = json.dumps(
        {"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x " * 4_000_000}}
    ).encode()
    results: list = [None] * 4

    def submit(i: int) -> None:
        start = time.monotonic()
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        headers = {"Authorization": f"Bearer {platform.api_key}", "Content-Type": "application/x-ndjson"}
        conn.request("POST", f"/v1/jobs?model={MODEL}", body=body, headers=headers)
        response = conn.getresponse()
        results[i] = (response.status, json.loads(response.read()), time.monotonic() - start)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (status, job, seconds) in enumerate(results):  # validated in the background: wait for the outcome
        assert status == 201 and job["status"] == "validating", job
        results[i] = (status, _wait_validated(url, platform.api_key, job["id"]), seconds)
    peak_kib = int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{worker.pid}/status").read_text()).group(1))
    print(f"peak {peak_kib / 1024:.0f} MiB, seconds {[round(r[2], 1) for r in results]}")
    assert peak_kib < 1024 * 1024, f"API worker peaked at {peak_kib / 1024:.0f} MiB"
    for status, job, seconds in results:
        assert status == 201 and job["status"] == "failed", job
        assert job["errors"][0]["code"] == "context_length_exceeded"
        assert seconds < 30, seconds  # each took 25 s alone (and 4.8 GB for two) before the bound
