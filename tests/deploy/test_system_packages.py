"""The README's test command on a fresh machine: its first step installs (or names) the system packages the
tests need, and `.ci/run` runs that command verbatim."""

from __future__ import annotations

import re
import subprocess

from tests import system_packages
from tests.helpers import REPO


def _readme_test_command() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"Install and run the tests:\s*```bash\n(.+?)\n```", text, re.S)
    assert block, "README.md lost its test command"
    return block.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim_and_it_starts_with_the_system_packages():
    command = _readme_test_command()
    assert command.startswith("python3 tests/system_packages.py && ")
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


def test_every_package_the_tests_need_is_here():
    """What this machine (the CI's) has: the same list the README's command would install."""
    assert system_packages.missing() == []
    assert subprocess.run(["python3", str(REPO / "tests" / "system_packages.py")]).returncode == 0


NEEDS = [("nginx", lambda: False, "a test"), ("g++", lambda: True, "a test")]


def test_missing_packages_are_installed_with_apt_get(monkeypatch):
    calls = []
    installed = {"nginx": False}
    needs = [("nginx", lambda: installed["nginx"], "a test"), ("g++", lambda: True, "a test")]

    def run(command, env):
        calls.append(command)
        if "install" in command:
            installed["nginx"] = True
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(system_packages, "installer", lambda: [])
    assert system_packages.main(needs, run=run) == 0
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx"]
    assert calls == [["apt-get", "update", "-qq"], install]


def test_without_root_or_apt_it_names_the_packages_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(system_packages, "installer", lambda: None)
    assert system_packages.main(NEEDS, run=lambda *a, **k: 1 / 0) == 1
    err = capsys.readouterr().err
    assert "missing system packages: nginx" in err and "apt-get install -y nginx" in err


def test_a_failed_install_says_so(monkeypatch, capsys):
    monkeypatch.setattr(system_packages, "installer", lambda: ["sudo", "-n"])
    seen = []

    def run(command, env):
        seen.append(command)
        return subprocess.CompletedProcess(command, 100)

    assert system_packages.main(NEEDS, run=run) == 1
    assert seen == [["sudo", "-n", "apt-get", "update", "-qq"]]
    assert "install nginx by hand" in capsys.readouterr().err
