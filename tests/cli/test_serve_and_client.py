"""The command line: `pagedbatch serve` on embedded PostgreSQL and Redis, the client commands, `run`."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from pagedbatch.cli import build_parser, main
from pagedbatch.engine_options import ENGINE_OPTIONS, engine_kwargs
from pagedbatch.supervisor import worker_command
from tests.helpers import REPO, chat_line, completion_line, free_port, jsonl, spawn, wait_until


@pytest.fixture(scope="module")
def served(platform, tmp_path_factory):
    """`pagedbatch serve` with no database or broker configured: everything embedded."""
    data = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    env["XDG_RUNTIME_DIR"] = str(data)
    log = data / "serve.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "pagedbatch",
            "serve",
            "--model",
            f"tiny={platform.model_path}",
            f"--port={port}",
            f"--data-dir={data / 'home'}",
            "--device=cpu",
        ],
        cwd=REPO,
        env=env,
        log=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while "serving on" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("pagedbatch serve did not start:\n" + log.read_text(errors="replace")[-4000:])
        time.sleep(0.2)
    assert "created an API key" in log.read_text(errors="replace")
    yield url, data / "home"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("pagedbatch serve did not stop on SIGTERM")


@pytest.mark.slow
def test_serve_and_client_commands(served, tmp_path, capsys, monkeypatch):
    served, home = served
    # no --api-key: the client commands use the key `serve` saved in its data dir (a local URL)
    monkeypatch.setenv("PAGEDBATCH_HOME", str(home))
    monkeypatch.delenv("PAGEDBATCH_API_KEY", raising=False)
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(f"s{i}", f"hello {i}") for i in range(6)] + ["{bad"]))
    out = tmp_path / "out.parquet"
    assert main(["submit", str(src), "--model", "tiny", "--url", served, "-o", str(out), "-q"]) == 0
    job_id = capsys.readouterr().out.strip().splitlines()[-1]
    assert job_id.startswith("batch_")
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["custom_id"] for r in rows if r["status"] == "completed") == [f"s{i}" for i in range(6)]

    assert main(["status", job_id, "--url", served, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "completed"
    assert main(["wait", job_id, "--url", served, "-q"]) == 0
    capsys.readouterr()
    jl = tmp_path / "out.jsonl"
    assert main(["download", job_id, "-o", str(jl), "--format", "jsonl", "--url", served, "-q"]) == 0
    assert len(jl.read_text().splitlines()) == 6
    errors = tmp_path / "errors.jsonl"
    assert main(["download", job_id, "-o", str(errors), "--errors", "--url", served, "-q"]) == 0
    assert len(errors.read_text().splitlines()) == 1


@pytest.mark.slow
def test_jobs_cancel_errors_and_doctor_against_serve(served, platform, tmp_path, capsys, monkeypatch):
    url, home = served
    for name in [n for n in os.environ if n.startswith("PAGEDBATCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PAGEDBATCH_HOME", str(home))  # serve's key, storage and (unset) services
    src = tmp_path / "in.jsonl"
    bad = {"custom_id": "nope", "method": "POST", "url": "/v1/nothing", "body": {}}
    src.write_bytes(jsonl([chat_line("ok-1", "hello"), bad]))
    assert main(["submit", str(src), "--model", "tiny", "--url", url, "--wait", "-q", "--strict"]) == 3
    job_id = capsys.readouterr().out.splitlines()[0]

    assert main(["jobs", "--url", url, "--json"]) == 0
    (job,) = [j for j in json.loads(capsys.readouterr().out)["data"] if j["id"] == job_id]
    assert (job["status"], job["request_counts"]["completed"], job["request_counts"]["invalid"]) == ("completed", 1, 1)
    assert main(["errors", job_id, "--url", url]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["nope", "invalid_url"]

    long = tmp_path / "long.jsonl"
    long.write_bytes(jsonl([chat_line(f"l{i}", "a story", 64, ignore_eos=True) for i in range(32)]))
    assert main(["submit", str(long), "--model", "tiny", "--url", url, "-q"]) == 0
    long_id = capsys.readouterr().out.strip()
    assert main(["cancel", long_id, "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] in ("cancelling", "cancelled")
    assert main(["wait", long_id, "--url", url, "-q", "--timeout", "60"]) == 4
    assert main(["cancel", job_id, "--url", url]) == 2  # a completed job cannot be cancelled
    assert "409" in capsys.readouterr().err

    assert main(["doctor", "--url", url, "--json", "--model", f"tiny={platform.model_path}"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["API"]["state"] == "ok" and checks["model tiny"]["state"] == "ok"
    assert "starts an embedded one" in checks["PostgreSQL"]["detail"]
    assert checks["storage"]["detail"].startswith(str(home / "storage"))


@pytest.mark.slow
def test_serve_restarts_a_worker_that_dies(served, tmp_path, capsys, monkeypatch):
    url, home = served
    log = home.parent / "serve.log"
    started = re.compile(r"worker for model 'tiny' started \(pid (\d+)\)")
    (first,) = started.findall(log.read_text(errors="replace"))
    os.kill(int(first), signal.SIGKILL)
    wait_until(
        lambda: len(started.findall(log.read_text(errors="replace"))) >= 2,
        60,
        what=lambda: "the worker's restart:\n" + log.read_text(errors="replace")[-4000:],
    )
    text = log.read_text(errors="replace")
    assert f"(pid {first}) exited with code -9; restarting it in 1s" in text
    assert "restarted (1 restarts so far)" in text

    monkeypatch.setenv("PAGEDBATCH_HOME", str(home))
    monkeypatch.delenv("PAGEDBATCH_API_KEY", raising=False)
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([chat_line(f"a{i}", f"again {i}") for i in range(3)]))
    out = tmp_path / "out.parquet"
    assert main(["submit", str(src), "--model", "tiny", "--url", url, "-o", str(out), "-q"]) == 0
    assert sorted(r["status"] for r in pq.read_table(out).to_pylist()) == ["completed"] * 3


def test_offline_run_command(platform, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([completion_line(f"o{i}", f"offline {i}") for i in range(5)] + ["nope"]))
    out = tmp_path / "offline.parquet"
    assert main(["run", str(src), "-o", str(out), "--model", platform.model_path, "-q", "--device=cpu"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["completed"] * 5 + ["failed"]
    # the README's example file: one line fails by design; the job still completed (0), or --strict says 3
    example = ["run", str(REPO / "examples" / "requests.jsonl"), "-o", str(out), "--model", platform.model_path]
    assert main([*example, "-q", "--device=cpu", "--strict"]) == 3


def test_offline_run_with_async_scheduling_gives_the_same_results(platform, tmp_path, monkeypatch):
    """`--async-scheduling=on` on the CPU: each step's tokens read a step late, the same responses (greedy,
    seeded sampling, logprobs, stops by EOS and by max_tokens)."""
    from engine.core import async_steps

    launched = []
    launch = async_steps.launch
    monkeypatch.setattr(async_steps, "launch", lambda *args: launched.append(1) or launch(*args))
    src = tmp_path / "in.jsonl"
    lines = [chat_line(f"c{i}", f"question {i}", max_tokens=6 + i) for i in range(4)]
    lines += [completion_line(f"s{i}", f"seeded {i}", 12, temperature=0.9, seed=i, logprobs=2) for i in range(4)]
    src.write_bytes(jsonl(lines))
    bodies = {}
    for mode in ("off", "on"):
        out = tmp_path / f"{mode}.parquet"
        argv = ["run", str(src), "-o", str(out), "--model", platform.model_path, "-q", "--device=cpu"]
        assert main([*argv, f"--async-scheduling={mode}"]) == 0
        rows = pq.read_table(out).to_pylist()
        assert [r["status"] for r in rows] == ["completed"] * 8
        bodies[mode] = [_answer(json.loads(r["response_body"])) for r in rows]
        assert bool(launched) == (mode == "on")
    assert bodies["on"] == bodies["off"]


def _answer(body: dict) -> tuple:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    logprobs = choice.get("logprobs") or {}
    return text, choice["finish_reason"], body["usage"]["completion_tokens"], logprobs.get("tokens")


def test_serve_hands_every_engine_option_to_its_workers():
    """Whatever engine option `serve` is given, the worker it starts builds its engine with it."""
    argv = ["serve", "--model", "tiny=/models/tiny", "--concurrency=3"]
    expected = {}
    for i, option in enumerate(ENGINE_OPTIONS):
        # none of them the default, each one the option accepts
        if option.name == "device":
            value = "cuda:1"
        elif option.choices:
            value = next(c for c in option.choices if c != option.default)
        else:
            value = option.type(str(7 + i))
        argv.append(f"{option.flag}={value}")
        expected[option.name] = value
    serve_args = build_parser().parse_args(argv)
    assert engine_kwargs(serve_args) == expected

    command = worker_command("tiny", "/models/tiny", serve_args)
    assert command[:4] == [sys.executable, "-m", "pagedbatch", "worker"]
    worker_args = build_parser().parse_args(command[3:])
    assert worker_args.func is not serve_args.func and worker_args.model == ["tiny=/models/tiny"]
    assert worker_args.concurrency == 3
    assert engine_kwargs(worker_args) == expected


def test_engine_options_default_to_the_engines_own_defaults():
    from engine.hf.config import EngineConfig

    defaults = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
    for option in ENGINE_OPTIONS:
        assert defaults[option.name] == option.default, option.name
    assert engine_kwargs(build_parser().parse_args(["worker", "--model", "tiny=/m"])) == {
        option.name: option.default for option in ENGINE_OPTIONS if option.default is not None
    }
