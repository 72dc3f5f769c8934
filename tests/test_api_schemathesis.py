"""Schemathesis against /openapi.json, as a client generator would trust it.

`test_the_contract_holds_under_schemathesis` runs the schemathesis CLI with every check (no 5xx, documented
statuses, content types, headers and bodies; schema-valid requests accepted, schema-violating ones
rejected; 405 with `Allow` for undeclared methods; auth not ignored; deleted objects gone), all phases, for
a bounded time (PAGEDBATCH_SCHEMATHESIS_SECONDS, 90 by default) against a live API with a valid key. Its
stateful phase follows the document's links from each create to the operations on what it made, so ids
are real. Any failure, and any warning (failed authentication, missing test data, ...), fails the test.
Jobs made here are not run (no worker), so their results answer 409 until validation fails them."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a minute and a half of generated requests

SECONDS = int(os.environ.get("PAGEDBATCH_SCHEMATHESIS_SECONDS", "90"))
CONFIG = """
[warnings]
fail-on = true
"""
# operations the stateful phase must reach through links with an id that exists (an answer other than 404)
LINKED = [
    "GET /v1/jobs/{id}", "POST /v1/jobs/{id}/cancel", "GET /v1/jobs/{id}/results", "GET /v1/jobs/{id}/errors",
    "GET /v1/batches/{id}", "POST /v1/batches/{id}/cancel", "GET /v1/files/{id}", "DELETE /v1/files/{id}",
]  # fmt: skip


def _label(method: str, uri: str) -> str:
    parts = uri.split("?")[0].split("/")[3:]  # scheme, empty, host
    ids = {"jobs", "batches", "files"}
    path = [p if i < 2 or parts[i - 1] not in ids else "{id}" for i, p in enumerate(parts)]
    return f"{method} /" + "/".join(path)


def _stateful_reached(vcr: Path) -> Counter:
    """Per operation, the stateful phase's requests answered with something other than 404."""
    with vcr.open() as f:
        recorded = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    reached = Counter()
    for interaction in recorded["http_interactions"]:
        response = interaction["response"]
        if interaction["phase"]["name"] == "stateful" and response and response["status"]["code"] != "404":
            reached[_label(interaction["request"]["method"], interaction["request"]["uri"])] += 1
    return reached


def test_the_contract_holds_under_schemathesis(platform, live_url, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
        f"{live_url}/openapi.json", "--checks", "all", "--max-time", str(SECONDS),
        "--header", f"Authorization: Bearer {platform.api_key}",
        "--report", "vcr", "--report-dir", str(tmp_path),
        *(["--seed", "39"] if os.environ.get("CI") else []),  # CI replays one run, so that a failure reproduces
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=SECONDS + 300, cwd=tmp_path)
    summary = run.stdout[run.stdout.find("= SUMMARY =") - 40 :]
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5000:]
    assert "No issues found" in summary and "WARNINGS" not in run.stdout, summary
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in summary, summary
    reached = _stateful_reached(next(tmp_path.glob("vcr-*.yaml")))
    missing = [label for label in LINKED if not reached[label]]
    assert not missing, (missing, reached)
