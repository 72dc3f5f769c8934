"""The image must hold every package pyproject installs (a missing COPY builds an image whose
`pip install .` leaves a package out), and a C++ compiler for the CPU engine's compiled kernels."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dockerfile_copies_every_package_pyproject_installs():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in patterns}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages == copied
    assert all((ROOT / p / "__init__.py").exists() for p in packages)


def test_the_image_has_a_cpp_compiler_for_inductor():
    assert re.search(r"apt-get install[^\n]*\bg\+\+", (ROOT / "Dockerfile").read_text())
