"""Shared test setup: fixtures for every module, the plugins that hold the platform's, and markers.

Markers (declared in pyproject.toml): `gpu` is set by hand; `platform` and `faults` follow from the
fixtures a test uses, so they cannot drift; `slow` is set by hand, on every platform test, and on the
tests tests/slow_tests.txt lists (measured: what keeps `pytest -m "not slow"` under 2 minutes on 2
cores). Tests marked `gpu` skip without CUDA.

Triton kernels run through Triton's interpreter on CPU tensors when there is no GPU;
the variable must be set before triton is first imported, hence here at the top.
"""

import functools
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

from engine.testing.tiny import write_tiny_model

pytest_plugins = ["tests.platform_fixtures", "tests.fault_fixtures", "tests.vision_helpers"]

# Property tests explore new inputs on every local run; CI replays a fixed set so that main stays green
# and a failure found there reproduces.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _startup_mode_restored():
    """`pagedbatch run` in-process and a deferred start set PAGEDBATCH_STARTUP for their whole process
    (pagedbatch_kernels.startup): not for the tests after them."""
    before = os.environ.get("PAGEDBATCH_STARTUP")
    yield
    if before is None:
        os.environ.pop("PAGEDBATCH_STARTUP", None)
    else:
        os.environ["PAGEDBATCH_STARTUP"] = before


@pytest.fixture(autouse=True)
def _small_prefix_groups_shared(request, monkeypatch):
    """The kernel tests check the shared-prefix path on small shapes: every shared block goes apart there,
    whatever the engine's bounds (pagedbatch_kernels.cpu.cpu_attention.SHARING_BOUNDS)."""
    if request.node.path.parent.name == "kernels":
        from pagedbatch_kernels.cpu import cpu_attention

        monkeypatch.setattr(cpu_attention, "SHARING_BOUNDS", {True: (1, 0), False: (1, 0)})


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine
    they oversubscribe it (several times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **config_overrides) -> path of a tiny random model, written once per session."""
    made = {}

    def make(arch: str = "qwen3", **overrides):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def baseline_library():
    """The native CPU kernels built for the compiler's default target: no -march=native, so no AVX
    (4-lane vectors, the portable reductions). Cached as every build is, under a key of its flags: the
    fast loop compiled it afresh each run (14 s)."""
    from pagedbatch_kernels.cpu import cpu_native

    flags = [f for f in cpu_native.FLAGS if not f.startswith("-march")]
    return cpu_native.bind(cpu_native.build(flags))


SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


@functools.cache
def _slow_entries() -> frozenset[str]:
    lines = (line.split("#")[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return frozenset(line for line in lines if line)


def _listed_slow(nodeid: str) -> bool:
    """A test is listed in tests/slow_tests.txt by its file or by `file::function` (every parametrization)."""
    path, _, rest = nodeid.partition("::")
    return path in _slow_entries() or f"{path}::{rest.split('[')[0]}" in _slow_entries()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "faults" in fixtures:  # private PostgreSQL and Redis that the test restarts, workers it kills
            item.add_marker(pytest.mark.faults)
        if "platform" in fixtures or "faults" in fixtures:  # PostgreSQL and Redis, maybe a worker
            item.add_marker(pytest.mark.platform)
            item.add_marker(pytest.mark.slow)  # a session's services and worker take longer than the fast loop
        if _listed_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
