"""Schemathesis against /openapi.json, as a client generator would trust it.

`test_the_contract_holds_under_schemathesis` runs the schemathesis CLI with every check (no 5xx, documented
statuses, content types, headers and bodies; schema-valid requests accepted, schema-violating ones
rejected; 405 with `Allow` for undeclared methods; auth not ignored; deleted objects gone), all phases, for
a bounded time (PAGEDBATCH_SCHEMATHESIS_SECONDS, 120 by default) against a live API with a valid key. Its
stateful phase follows the document's links from each create to the operations on what it made, so ids
are real. Any failure, and any warning but missing test data (see CONFIG), fails the test.
Jobs made here are not run (no worker), so their results answer 409 until validation fails them."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.platform_fixtures import Harness

SECONDS = int(os.environ.get("PAGEDBATCH_SCHEMATHESIS_SECONDS", "120"))
CONFIG = """
# Every warning fails the run but missing_test_data: completing an upload names parts of it in its body, so
# made-up part ids are 404s by design in every phase, and which other id-taking operation drew mostly 404s varies
# from run to run (a per-operation override does not reach this warning). LINKED below holds the operations that
# matter to a real answer instead.
[warnings]
fail-on = ["missing_auth", "base_url_mismatch", "validation_mismatch", "missing_deserializer", "unused_openapi_auth",
           "unsupported_regex", "method_not_allowed", "unresolvable_reference"]

# A body over the API's limit is refused with 413 before it is read: a rejection like the default list's statuses
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]

# POST /v1/jobs as multipart: every form field is text, so a generated type violation of a scalar (priority 92 as the
# string "92", dry_run as a boolean) is sent as the same bytes as the valid value, and a JSON part's generated
# "violation" may decode to a valid value; the negative-data check then calls a valid request "schema-violating,
# accepted" (CI replayed such bodies). The API's own checks of those fields are tested in tests/api/test_contract.py;
# every other check still runs on this operation. (`include-name`: separate include-path and include-method keys
# select every POST and every /v1/jobs operation; and the command line names no checks, since `--checks all` would
# turn this back on: the command line outranks the file.)
[[operations]]
include-name = "POST /v1/jobs"
checks.negative_data_rejection.enabled = false
"""
# operations the stateful phase must reach through links with an id that exists (an answer other than 404)
LINKED = [
    "GET /v1/jobs/{id}",
    "POST /v1/jobs/{id}/cancel",
    "GET /v1/jobs/{id}/results",
    "GET /v1/jobs/{id}/errors",
    "GET /v1/batches/{id}",
    "POST /v1/batches/{id}/cancel",
    "GET /v1/files/{id}",
    "DELETE /v1/files/{id}",
]


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


@pytest.fixture(scope="module")
def own_platform():
    """A platform of its own: what the generated requests leave behind (webhook endpoints to made-up hosts, jobs,
    files) must not reach the session's shared platform, whose worker would deliver later tests' events to them."""
    harness = Harness()
    yield harness
    harness.close()


def test_the_configuration_turns_off_one_check_of_one_operation_only():
    """What CONFIG says, as schemathesis reads it: every check on (max_response_time needs a limit) for every
    operation and phase, but the negative-data check of POST /v1/jobs."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.config._checks import _BUILTIN_CHECK_NAMES

    from api.spec.openapi import openapi_document

    schema = schemathesis.openapi.from_dict(openapi_document(("tiny",)), config=SchemathesisConfig.from_str(CONFIG))
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) > 20
    for operation in operations:
        for phase in ("examples", "coverage", "fuzzing", "stateful"):
            checks = schema.config.checks_config_for(operation=operation, phase=phase)
            off = {n for n in _BUILTIN_CHECK_NAMES if not checks.get_by_name(name=n).enabled}
            expected = {"max_response_time"}
            if (operation.method.upper(), operation.path) == ("POST", "/v1/jobs"):
                expected.add("negative_data_rejection")
            assert off == expected, (operation.method, operation.path, phase)


def _schemathesis(platform, live_url: str, workdir: Path, seconds: int, phases: str | None = None):
    """(the run's summary, per operation its stateful requests answered with other than 404)."""
    workdir.mkdir(exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{live_url}/openapi.json",
        "--max-time",
        str(seconds),
        "--header",
        f"Authorization: Bearer {platform.api_key}",
        "--report",
        "vcr",
        "--report-dir",
        str(workdir),
        *(["--phases", phases] if phases else []),
        *(["--seed", "39"] if os.environ.get("CI") else []),  # CI replays one run, so that a failure reproduces
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 300, cwd=workdir)
    summary = run.stdout[run.stdout.find("= SUMMARY =") - 40 :]
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5000:]
    # a warning other than missing test data fails the run (CONFIG); LINKED below holds the id-taking operations
    # to a real answer, whichever operations that warning names in a run
    assert "Failures:" not in summary and "Test cases:" in summary, summary
    return summary, _stateful_reached(next(workdir.glob("vcr-*.yaml")))


@pytest.mark.slow  # two minutes of generated requests
def test_the_contract_holds_under_schemathesis(own_platform, tmp_path):
    platform, live_url = own_platform, own_platform.start_server()
    summary, reached = _schemathesis(platform, live_url, tmp_path / "all", SECONDS)
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in summary, summary
    missing = [label for label in LINKED if not reached[label]]
    if missing:  # the stateful phase's share of the time ran out first (a slow machine): it goes on alone
        _, more = _schemathesis(platform, live_url, tmp_path / "stateful", SECONDS // 2, phases="stateful")
        reached += more
        missing = [label for label in LINKED if not reached[label]]
    assert not missing, (missing, reached)
