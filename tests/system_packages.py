"""The system packages the tests need beyond Python's, installed where this machine lets us.

Run by the README's test command before anything else (`python3 tests/system_packages.py`): it checks for
each package below, installs the missing ones with apt-get (as root, or through sudo without a password),
and otherwise names them and the command that installs them, and exits 1. Standard library only: it runs
before the virtual environment exists.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path


def _nginx() -> bool:
    return bool(shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin"))


def _python_headers() -> bool:
    return (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()


# (Debian package, is it here, who needs it)
NEEDS: list[tuple[str, Callable[[], bool], str]] = [
    ("python3-venv", lambda: importlib.util.find_spec("ensurepip") is not None, "python3 -m venv"),
    ("g++", lambda: bool(shutil.which("c++") or shutil.which("g++")), "the native CPU kernels, inductor"),
    ("python3-dev", _python_headers, "inductor's C++ kernels (Python.h)"),
    ("nginx", _nginx, "tests/deploy/test_nginx_proxy.py"),
    ("chromium", lambda: os.access("/usr/bin/chromium", os.X_OK), "tests/platform/test_ui.py"),
    ("chromium-driver", lambda: os.access("/usr/bin/chromedriver", os.X_OK), "tests/platform/test_ui.py"),
]


def missing(needs=None) -> list[str]:
    return [package for package, present, _ in (NEEDS if needs is None else needs) if not present()]


def installer() -> list[str] | None:
    """The command prefix that may run apt-get here: [] as root, ["sudo", "-n"] with password-less sudo."""
    if shutil.which("apt-get") is None:
        return None
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo and subprocess.run([sudo, "-n", "true"], capture_output=True).returncode == 0:
        return [sudo, "-n"]
    return None


def main(needs=None, run=subprocess.run) -> int:
    packages = missing(needs)
    if not packages:
        return 0
    names = " ".join(packages)
    prefix = installer()
    if prefix is None:
        print(
            f"tests: missing system packages: {names}; install them first, e.g. "
            f"'sudo apt-get install -y {names}', then run this again",
            file=sys.stderr,
        )
        return 1
    print(f"tests: installing the system packages the tests need: {names}", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        if run([*prefix, *command], env=env).returncode != 0:
            print(f"tests: '{' '.join(command)}' failed; install {names} by hand", file=sys.stderr)
            return 1
    still = missing(needs)
    if still:
        print(f"tests: still missing after apt-get: {' '.join(still)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
