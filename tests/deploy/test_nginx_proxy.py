"""deploy/nginx.conf.template, the very file docker-compose runs, in front of `pagedbatch api` (gunicorn):
100 slow clients do not delay anyone else through nginx (they do, directly against gunicorn), and
nginx's own error pages are OpenAI error JSON. Needs Debian's nginx (`apt-get install -y nginx`)."""

import contextlib
import getpass
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from api.routes.uploads import FRAMING_ROOM
from store.settings import Settings
from tests.helpers import MODEL, REPO, chat_line, free_port, jsonl, spawn

TEMPLATE = REPO / "deploy" / "nginx.conf.template"
SLOW_CLIENTS = 100
TRICKLE_S = 6.0  # how long the slow clients trickle: under nginx's 10 s client_header_timeout


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/healthz", timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(log.read_text()[-3000:]) from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def gunicorn_port(platform):
    """`pagedbatch api` (gunicorn, one worker process of 8 threads) on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedbatch", "api", "--host=127.0.0.1", f"--port={port}", "--workers=1"]
    cmd += ["--model", f"{MODEL}={platform.model_path}"]
    log = platform.tmp / "nginx-gunicorn.log"
    env = {**os.environ, **platform.settings.to_env()}
    proc = spawn(cmd, log, cwd=REPO, env=env, start_new_session=True)
    _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    yield port
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def render_config(temp_dir: Path, listen_port: int, upstream_port: int, max_body: str) -> str:
    """The template with the values docker-compose's envsubst gives it, here for loopback ports."""
    values = {
        "NGINX_USER": getpass.getuser(),
        "NGINX_LISTEN": f"127.0.0.1:{listen_port}",
        "PAGEDBATCH_UPSTREAM": f"127.0.0.1:{upstream_port}",
        "NGINX_TEMP_DIR": str(temp_dir),
        "NGINX_MAX_BODY": max_body,
    }
    text = TEMPLATE.read_text()
    for name, value in values.items():
        text = text.replace("${" + name + "}", value)
    assert "${" not in text, "the template has a placeholder this test does not fill"
    return text


def _nginx_binary() -> str:
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if nginx is None:
        pytest.fail("nginx is not installed: `apt-get install -y nginx` (.ci/run installs it)")
    return nginx


@contextlib.contextmanager
def running_nginx(upstream_port: int, max_body: str):
    """nginx with the rendered template on a free loopback port, checked with `nginx -t` first: yields its port."""
    nginx = _nginx_binary()
    temp_dir = Path(tempfile.mkdtemp(prefix="pagedbatch-nginx-"))
    port = free_port()
    conf = temp_dir / "nginx.conf"
    conf.write_text(render_config(temp_dir, port, upstream_port, max_body))
    check = subprocess.run([nginx, "-t", "-e", "stderr", "-p", str(temp_dir), "-c", str(conf)], capture_output=True)
    assert check.returncode == 0, check.stderr.decode()
    cmd = [nginx, "-e", "stderr", "-p", str(temp_dir), "-c", str(conf), "-g", "daemon off;"]
    proc = spawn(cmd, temp_dir / "nginx.log", start_new_session=True)
    try:
        _wait_listening(port, proc, temp_dir / "nginx.log")
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)


@pytest.fixture(scope="module")
def nginx_port(gunicorn_port):
    with running_nginx(gunicorn_port, "2m") as port:  # a small body limit, to test 413 cheaply
        yield port


# ---- a normal client and 100 slow ones ---------------------------------------------------------------


def _upload_body() -> tuple[bytes, str]:
    boundary = "pagedbatchboundary"
    data = jsonl([chat_line("a", "hi")])
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f"multipart/form-data; boundary={boundary}"


def normal_requests(port: int, key: str, timeout: float) -> list[float]:
    """Seconds each of a normal client's requests took (GET /v1/models, a small upload, GET /healthz);
    a request that does not finish within `timeout` counts as `timeout`."""
    body, content_type = _upload_body()
    requests = [
        ("GET", "/v1/models", None, {}),
        ("POST", "/v1/files", body, {"Content-Type": content_type}),
        ("GET", "/healthz", None, {}),
    ]
    took = []
    for method, path, data, headers in requests:
        start = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
            conn.request(method, path, body=data, headers={"Authorization": f"Bearer {key}", **headers})
            response = conn.getresponse()
            response.read()
            conn.close()
            assert response.status == 200, (method, path, response.status)
            took.append(time.monotonic() - start)
        except TimeoutError:
            took.append(timeout)
    return took


def trickle(port: int, key: str, count: int, seconds: float) -> None:
    """`count` slow clients for `seconds`: half send their headers one byte a second, half send a whole
    authenticated upload's headers and then its file one byte a second; then they all hang up."""
    boundary = "slowboundary"
    preamble = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n'
    )
    upload_head = (
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: 100000\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n{preamble}"
    )
    socks = []
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(upload_head.encode() if i % 2 else b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for s in socks:
                with contextlib.suppress(OSError):  # a server may hang up on a slow client: that is its right
                    s.send(b"a")
            time.sleep(1)
    finally:
        for s in socks:
            s.close()


def latency_under_slow_clients(port: int, key: str) -> tuple[float, float]:
    """(worst idle latency, worst latency while SLOW_CLIENTS trickle) of the normal client."""
    normal_requests(port, key, timeout=10)  # warm up
    idle = max(max(normal_requests(port, key, timeout=10)) for _ in range(3))
    slow = threading.Thread(target=trickle, args=(port, key, SLOW_CLIENTS, TRICKLE_S), daemon=True)
    slow.start()
    time.sleep(1.5)  # every slow client connected and started
    loaded = max(normal_requests(port, key, timeout=3))
    slow.join(timeout=TRICKLE_S + 30)
    assert not slow.is_alive()
    return idle, loaded


@pytest.mark.slow
def test_slow_clients_do_not_delay_others_through_nginx(platform, nginx_port):
    idle, loaded = latency_under_slow_clients(nginx_port, platform.api_key)
    print(f"\nthrough nginx: normal client idle {idle:.3f} s, with {SLOW_CLIENTS} slow clients {loaded:.3f} s")
    assert loaded <= idle + 1.0


@pytest.mark.slow
def test_the_same_slow_clients_delay_others_directly_against_gunicorn(platform, gunicorn_port, nginx_port):
    """The control: without nginx, gunicorn's 8 threads are taken by slow clients and a normal request
    waits (here it gives up after 3 s), so the proxy is what keeps the other clients' latency."""
    idle, loaded = latency_under_slow_clients(gunicorn_port, platform.api_key)
    print(f"\ndirect to gunicorn: normal client idle {idle:.3f} s, with {SLOW_CLIENTS} slow clients {loaded:.3f} s")
    assert loaded > idle + 1.0
    assert max(normal_requests(nginx_port, platform.api_key, timeout=10)) < 5  # all back to normal


def _upload(port: int, key: str, data: bytes) -> str:
    boundary = "bigboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": f"multipart/form-data; boundary={boundary}"}
    conn.request("POST", "/v1/files", body=body, headers=headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()[:500]
    return json.loads(response.read())["id"]


def stalled_downloads(port: int, key: str, file_id: str, count: int) -> list[socket.socket]:
    """`count` clients that ask for a file and read nothing (a 4 KB receive window each)."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(
            f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        )
        socks.append(s)
    return socks


@pytest.mark.slow
def test_stalled_downloads_hold_nginx_not_gunicorn(platform, gunicorn_port, nginx_port):
    """Proxy buffering: nginx reads a 9 MB answer from gunicorn at once and feeds it to a client that does
    not read; directly, each such client holds one of gunicorn's threads until it reads or hangs up."""
    key = platform.api_key
    big = jsonl([chat_line(f"r{i}", "hi " * 100) for i in range(20_000)])  # 9 MB: more than the socket buffers hold
    file_id = _upload(gunicorn_port, key, big)
    for port, held in ((nginx_port, False), (gunicorn_port, True)):
        socks = stalled_downloads(port, key, file_id, 20)
        try:
            time.sleep(1.5)
            took = max(normal_requests(port, key, timeout=3))
        finally:
            for s in socks:
                s.close()
        print(f"\n20 stalled downloads on port {port} ({'gunicorn' if held else 'nginx'}): normal client {took:.3f} s")
        assert (took >= 3) == held


# ---- nginx's own errors --------------------------------------------------------------------------------


def _raw(port: int, request: bytes) -> tuple[int, str, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        conn = http.client.HTTPResponse(s)
        conn.begin()
        return conn.status, conn.getheader("Content-Type"), json.loads(conn.read())


@pytest.mark.parametrize(
    "request_bytes, status, code",
    [
        (b"GET /v1/files?x=" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "request_uri_too_long"),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 400, None),
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n", 413, "request_entity_too_large"),
    ],
    ids=["414-long-url", "400-long-header", "400-garbage", "413-body-over-limit"],
)
def test_nginx_errors_are_openai_json(nginx_port, request_bytes, status, code):
    got_status, content_type, body = _raw(nginx_port, request_bytes)
    assert got_status == status
    assert content_type == "application/json"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == (code or "request_header_fields_too_large") and error["message"]


def test_nginx_answers_json_502_when_gunicorn_is_down():
    with running_nginx(free_port(), "201m") as port:  # nothing listens upstream
        status, content_type, body = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, content_type) == (502, "application/json")
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "bad_gateway"


def test_compose_publishes_only_nginx_with_every_placeholder_filled():
    """docker-compose.yml cannot be run here (no Docker daemon): check it fills the template this module runs."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    proxy, api = services["proxy"], services["api"]
    assert "ports" not in api and api["expose"] == ["8000"]
    assert proxy["ports"] == ["8000:8000"] and proxy["depends_on"]["api"] == {"condition": "service_healthy"}
    assert "./deploy/nginx.conf.template:/etc/nginx/templates/nginx.conf.template:ro" in proxy["volumes"]
    env = proxy["environment"]
    assert env["NGINX_ENVSUBST_OUTPUT_DIR"] == "/etc/nginx"  # the image writes /etc/nginx/nginx.conf
    placeholders = set(re.findall(r"\$\{(\w+)\}", TEMPLATE.read_text()))
    assert placeholders == set(env) - {"NGINX_ENVSUBST_OUTPUT_DIR"}
    assert env["PAGEDBATCH_UPSTREAM"] == "api:8000"
    upload_limit = Settings().max_upload_bytes + FRAMING_ROOM
    assert env["NGINX_MAX_BODY"] == f"{upload_limit >> 20}m" and upload_limit % (1 << 20) == 0
