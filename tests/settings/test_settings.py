"""The settings home: every environment variable is read in `settings/`, typed, checked at start with
an error that names it, and docs/configuration.md is generated from the classes."""

from __future__ import annotations

import re

import pytest

import settings
from pagedbatch.cli import main
from settings import EngineSettings, PlatformSettings, SettingsError, WorkerSettings, current, value
from settings.docs import PATH, render
from store.settings import Settings
from tests.helpers import REPO

SOURCE_DIRS = ("tests", "bench", ".venv", ".git")


def _sources():
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] not in SOURCE_DIRS and not rel.parts[0].startswith("."):
            yield rel, path.read_text()


def test_configuration_doc_is_the_generated_text():
    assert PATH.read_text() == render(), "docs/configuration.md is stale: python -m settings.docs --write"


def test_only_the_settings_home_touches_the_environment():
    readers = {str(rel) for rel, text in _sources() if re.search(r"os\.environ|getenv", text)}
    assert readers == {"settings/base.py"}


def test_every_variable_the_code_names_is_a_setting():
    declared = {v for kind in settings.KINDS for v in kind.variables().values()}
    named = {name for _, text in _sources() for name in re.findall(r"\bPAGEDBATCH_[A-Z0-9_]*[A-Z0-9]\b", text)}
    assert named - declared == set()


def test_a_bad_value_names_its_variable(monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_SHARD_SIZE", "many")
    monkeypatch.setenv("PAGEDBATCH_CPU_PREFIX", "fastest")
    with pytest.raises(SettingsError) as caught:
        settings.check_environment()
    assert "PAGEDBATCH_SHARD_SIZE='many'" in str(caught.value)
    assert "PAGEDBATCH_CPU_PREFIX='fastest'" in str(caught.value)
    with pytest.raises(SettingsError, match="PAGEDBATCH_SHARD_SIZE"):
        Settings.from_env()


def test_the_command_line_stops_at_start_on_a_bad_value(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDBATCH_LEASE_S", "-1")
    assert main(["jobs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedbatch: bad environment: WorkerSettings: PAGEDBATCH_LEASE_S='-1'"), err
    assert len(err.strip().splitlines()) == 1


def test_reads_follow_the_environment(monkeypatch):
    monkeypatch.delenv("PAGEDBATCH_CPU_PREFILL", raising=False)
    assert value(EngineSettings, "cpu_prefill") is None
    monkeypatch.setenv("PAGEDBATCH_CPU_PREFILL", "matmul")
    assert value(EngineSettings, "cpu_prefill") == "matmul"
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "0")
    assert current(WorkerSettings).fair_share is False
    monkeypatch.setenv("PAGEDBATCH_FAIR_SHARE", "")  # empty: unset, the default
    assert current(WorkerSettings).fair_share is True


def test_platform_settings_round_trip_through_a_child_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDBATCH_HOME", str(tmp_path))
    monkeypatch.setenv("PAGEDBATCH_MODELS", "a=/m/a,/m/b")
    monkeypatch.setenv("PAGEDBATCH_MAX_LINES", "7")
    here = Settings.from_env(shard_size=3)
    assert here.storage_url == str(tmp_path / "storage")
    assert here.models == {"a": "/m/a", "b": "/m/b"} and here.max_lines == 7 and here.shard_size == 3
    for name, text in here.to_env().items():
        monkeypatch.setenv(name, text)
    assert Settings.from_env() == here
    assert current(PlatformSettings).max_lines == 7
