"""Shared test setup.

Triton kernels run through Triton's interpreter on CPU tensors when there is no GPU;
the variable must be set before triton is first imported, hence here at the top.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests explore new inputs on every local run; CI replays a fixed set so that main stays green
# and a failure found there reproduces.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from engine.tiny import write_tiny_model  # noqa: E402


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


def assert_pool_free(engine) -> None:
    """No leaked block and nothing left running."""
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == engine.block_manager.num_blocks
