"""The CLI's user paths stay light: `pagedbatch --help`, `submit` and `status` (here against an API that is
not there, so they run their whole client path up to the connection) import neither torch, transformers
nor Flask."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import contextlib, io, json, sys
from pagedbatch.cli import main

with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        status = main(json.loads(sys.argv[1]))
    except SystemExit as e:
        status = e.code
heavy = sorted(m for m in ("torch", "transformers", "flask") if m in sys.modules)
print(json.dumps({"status": status, "heavy": heavy}))
"""
DEAD_API = ["--url", "http://127.0.0.1:9", "--api-key", "k"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["submit", "--help"],
        ["status", *DEAD_API, "job-1"],
        ["submit", *DEAD_API, "--model", "tiny", "--wait", "REQUESTS"],
        ["jobs", *DEAD_API],
    ],
)
def test_client_paths_import_no_torch(argv, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    argv = [str(requests) if a == "REQUESTS" else a for a in argv]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], result
    assert result["status"] == (0 if "--help" in argv else 1)  # help, or the unreachable API's one-line failure
