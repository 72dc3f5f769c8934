"""A vLLM user's scripts, rewritten for `from engine import ...` and a tiny random model."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.testing.tiny import write_tiny_model
from tests.helpers import assert_pool_free


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vllm-compat") / "model")


@pytest.fixture(scope="package")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, max_logprobs=-1)


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_free(request.getfixturevalue("llm").llm_engine)
