"""Every command answers a mistake with one short line on stderr, no traceback, and its documented exit
status (pagedbatch/failures.py): each case runs `python -m pagedbatch` as a person would type it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedbatch.cli import main
from tests.helpers import REPO, completion_line, free_port, jsonl

USAGE, ERROR = 2, 1


def pagedbatch(argv: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "pagedbatch", *argv],
        cwd=REPO,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line(done: subprocess.CompletedProcess, status: int, text: str) -> None:
    said = f"exit {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    assert done.returncode == status, said
    assert "Traceback" not in done.stderr + done.stdout, said
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 3, said
    assert text in done.stderr, said


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("mistakes")
    good = tmp / "good.jsonl"
    good.write_bytes(jsonl([completion_line("a", "hello")]))
    unsupported = tmp / "gpt2"
    shutil.copytree(tiny_model("qwen3"), unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    (tmp / "no-config").mkdir()
    return {
        "tmp": tmp,
        "good": str(good),
        "model": str(tiny_model("qwen3")),
        "unsupported": str(unsupported),
        "no_config": str(tmp / "no-config"),
        "down": f"http://127.0.0.1:{free_port()}",
    }


def _cases(i: dict) -> list[tuple[list[str], dict, int, str]]:
    """(argv, environment, exit status, text the message holds)."""
    good, model, down, tmp = i["good"], i["model"], i["down"], i["tmp"]
    run = ["run", good, "-o", str(tmp / "out.parquet"), "--model", model]
    home = {"PAGEDBATCH_HOME": str(tmp / "home"), "PAGEDBATCH_API_KEY": "pb-no-such-key"}  # no key lookup
    no_db = "postgresql://pagedbatch@127.0.0.1:1/nothing"
    return [
        ([], {}, USAGE, "the following arguments are required: COMMAND"),
        (["frobnicate"], {}, USAGE, "invalid choice: 'frobnicate'"),
        # tiny-model
        (["tiny-model", "/etc/passwd/tiny"], {}, USAGE, "cannot write the model to /etc/passwd/tiny"),
        (["tiny-model", str(tmp / "t"), "--arch", "gpt2"], {}, USAGE, "invalid choice: 'gpt2'"),
        (["tiny-model", str(tmp / "t"), "--embedding", "--matryoshka", "a,b"], {}, USAGE, "expected sizes"),
        # run
        (["run", "data.jsonl", "-o", "x.parquet", "--model", model], {}, USAGE, "no such file: data.jsonl"),
        (["run", str(tmp), "-o", "x.parquet", "--model", model], {}, USAGE, "is a directory"),
        (["run", good, "-o", "x.parquet", "--model", "/no/such/model"], {}, USAGE, "no such model directory"),
        (["run", good, "-o", "x.parquet", "--model", good], {}, USAGE, "is a file; give a model directory"),
        (["run", good, "-o", "x.parquet", "--model", i["no_config"]], {}, USAGE, "has no config.json"),
        ([*run, "--defaults", "{bad"], {}, USAGE, "--defaults: not a JSON object"),
        ([*run, "--defaults", "[1]"], {}, USAGE, "not a JSON object"),
        ([*run, "--dtype", "int3"], {}, USAGE, "invalid choice: 'int3'"),
        ([*run, "--device", "tpu"], {}, USAGE, "'tpu' is not a device"),
        ([*run, "--max-num-seqs", "0"], {}, USAGE, "at least 1"),
        (["run", good, "-o", "/no/such/dir/out.parquet", "--model", model], {}, USAGE, "cannot write"),
        # servers
        (["serve"], {}, USAGE, "--model"),
        (["serve", "--model", "tiny=/no/such/model"], home, USAGE, "--model tiny: no such model directory"),
        (["serve", "--model", f"tiny={model}", "--port", "eighty"], {}, USAGE, "invalid int value"),
        (["serve", "--model", "=x"], home, USAGE, "bad model spec"),
        (["api", "--model", "tiny=/no/such/model"], {}, USAGE, "no such model directory"),
        (["api", "--model", "tiny="], {}, USAGE, "bad setting: bad model spec"),
        (["api", "--workers", "two"], {}, USAGE, "invalid int value"),
        (["worker", "--model", f"a={model}", "--model", f"b={model}"], {}, USAGE, "exactly one --model"),
        (["worker", "--model", "a=/no/such/model"], {}, USAGE, "no such model directory"),
        (["worker", "--model", f"a={model}", "--role", "boss"], {}, USAGE, "invalid choice: 'boss'"),
        (["migrate"], {}, USAGE, "set PAGEDBATCH_DATABASE_URL"),
        (["migrate"], {"PAGEDBATCH_DATABASE_URL": no_db}, ERROR, "cannot reach the database"),
        (["migrate"], {"PAGEDBATCH_DATABASE_URL": "not a url"}, USAGE, "not a database URL"),
        # admin
        (["keys"], {}, USAGE, "required"),
        (["keys", "list"], {}, USAGE, "set PAGEDBATCH_DATABASE_URL"),
        (["keys", "create", "--database-url", no_db], {}, ERROR, "cannot reach the database"),
        (["keys", "revoke", "key_x", "--database-url", no_db], {}, ERROR, "cannot reach the database"),
        (["tenants", "set", "t", "--weight", "-1"], {}, USAGE, "a weight is a positive number"),
        (["tenants", "set", "t", "--max-files", "many"], {}, USAGE, "invalid int value"),
        (["tenants", "list", "--database-url", "nonsense"], {}, USAGE, "not a database URL"),
        # client
        (["submit", good, "--model", "tiny", "--url", down], home, ERROR, f"cannot reach the API at {down}"),
        (["submit", "nope.jsonl", "--model", "tiny"], home, USAGE, "no such file: nope.jsonl"),
        (["submit", good], home, USAGE, "--model"),
        (["submit", good, "--model", "tiny", "--metadata", "{"], home, USAGE, "--metadata: not a JSON object"),
        (["submit", good, "--model", "tiny", "-o", "/no/such/dir/r.parquet"], home, USAGE, "cannot write"),
        (["submit", good, "--model", "tiny", "--url", "localhost:8000"], home, USAGE, "is not an API URL"),
        (["quote", good, "--model", "tiny", "--url", down], home, ERROR, f"cannot reach the API at {down}"),
        (["quote", "nope.jsonl", "--model", "tiny"], home, USAGE, "no such file: nope.jsonl"),
        (["quote", good], home, USAGE, "--model"),
        (["status", "batch_x", "--url", down], home, ERROR, "is 'pagedbatch serve' running?"),
        (["status"], home, USAGE, "job_id"),
        (["wait", "batch_x", "--url", down], home, ERROR, "cannot reach the API"),
        (["wait", "batch_x", "--timeout", "soon"], home, USAGE, "invalid float value"),
        (["download", "batch_x", "-o", "r.parquet", "--url", down], home, ERROR, "cannot reach the API"),
        (["download", "batch_x", "-o", "/no/such/dir/r.parquet"], home, USAGE, "cannot write"),
        (["download", "batch_x", "-o", "r.parquet", "--format", "csv"], home, USAGE, "invalid choice: 'csv'"),
        (["jobs", "--url", down], home, ERROR, "cannot reach the API"),
        (["jobs", "--limit", "all"], home, USAGE, "invalid int value"),
        (["cancel", "batch_x", "--url", down], home, ERROR, "cannot reach the API"),
        (["errors", "batch_x", "--url", down], home, ERROR, "cannot reach the API"),
        (["errors", "batch_x", "--url", "ftp://x"], home, USAGE, "is not an API URL"),
        (["webhooks", "--url", down], home, ERROR, "cannot reach the API"),
        (["webhooks", "--limit", "all"], home, USAGE, "invalid int value"),
        # doctor
        (["doctor", "--device", "tpu"], {}, USAGE, "'tpu' is not a device"),
        (["doctor", "--url", "x"], {}, USAGE, "is not an API URL"),
    ]


def test_every_command_answers_a_mistake_in_one_line(inputs):
    import socket

    busy = socket.create_server(("127.0.0.1", 0))  # a port something listens on
    port = busy.getsockname()[1]
    cases = [
        *_cases(inputs),
        (
            ["serve", "--model", f"tiny={inputs['model']}", "--port", str(port)],
            {"PAGEDBATCH_HOME": str(inputs["tmp"] / "home")},
            ERROR,
            f"cannot listen on 127.0.0.1:{port}",
        ),
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: pagedbatch(case[0], case[1]), cases))
    busy.close()
    for (argv, _, status, text), done in zip(cases, results):
        try:
            assert_one_line(done, status, text)
        except AssertionError as exc:
            raise AssertionError(f"pagedbatch {' '.join(argv)}: {exc}") from None
    covered = {argv[0] for argv, *_ in cases if argv}
    from pagedbatch.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(commands) <= covered, "every command has its mistakes here"


@pytest.mark.slow  # these two load a tokenizer, or torch and the engine
def test_run_answers_bad_contents_in_one_line(inputs):
    tmp, model = inputs["tmp"], inputs["model"]
    cases = [
        (["run", "/etc/passwd", "-o", str(tmp / "p.parquet"), "--model", model], "none of its"),
        (
            ["run", inputs["good"], "-o", str(tmp / "u.parquet"), "--model", inputs["unsupported"]],
            "unsupported architecture ['GPT2LMHeadModel']",
        ),
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: pagedbatch(case[0]), cases))
    for (_, text), done in zip(cases, results):
        assert_one_line(done, USAGE, text)


def test_debug_shows_the_traceback(inputs):
    down = ["status", "batch_x", "--url", inputs["down"]]
    for argv, env in ((["--debug", *down], {}), ([*down, "--debug"], {}), (down, {"PAGEDBATCH_DEBUG": "1"})):
        done = pagedbatch(argv, env)
        assert done.returncode == ERROR and "Traceback" in done.stderr and "cannot reach the API" in done.stderr


def test_an_internal_error_is_one_line_that_says_where_the_traceback_is(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PAGEDBATCH_HOME", str(tmp_path))
    monkeypatch.delenv("PAGEDBATCH_DEBUG", raising=False)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nwith more lines")

    monkeypatch.setattr("pagedbatch.job_view.jobs_table", broken)
    monkeypatch.setattr("pagedbatch.client.Client.jobs", lambda self, **kw: {"data": [], "has_more": False})
    assert main(["jobs", "--url", "http://127.0.0.1:1"]) == ERROR
    err = capsys.readouterr().err
    saved = tmp_path / "last-cli-error.txt"
    assert err == f"pagedbatch: internal error: RuntimeError: a bug (traceback in {saved}; --debug prints it)\n"
    assert "Traceback" in saved.read_text() and "def broken" not in err


def test_run_exits_2_on_a_file_without_requests_before_the_model_loads(tiny_model, tmp_path, monkeypatch, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(jsonl(["not json", {"custom_id": "x", "method": "GET", "url": "/v1/nothing", "body": {}}, ""]))
    loaded = []
    monkeypatch.setattr("engine.LLM", lambda *a, **k: loaded.append(1))
    assert main(["run", str(src), "-o", str(tmp_path / "o.parquet"), "--model", str(tiny_model("qwen3"))]) == USAGE
    assert "none of its 2 lines is a request (line 1: invalid_json" in capsys.readouterr().err
    assert loaded == [] and not (tmp_path / "o.parquet").exists()
