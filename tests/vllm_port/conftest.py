"""vLLM's own offline-API tests, ported: the same calls and the same assertions, `vllm` imports spelled
`engine`, and vLLM's hub models replaced by one tiny random model (see README.md for what was ported from
where, and what cannot apply). One engine serves the whole package, so the port runs in about a minute."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.testing.tiny import write_tiny_model
from tests.helpers import assert_pool_free

# vLLM's example prompts (tests/prompts/example.txt's first lines are of this kind)
EXAMPLE_PROMPTS = [
    "vLLM is a high-throughput and memory-efficient inference and serving engine for LLMs.",
    "Briefly describe the major milestones in the development of artificial intelligence from 1950 to 2020.",
    "Compare and contrast artificial intelligence with human intelligence in terms of processing information.",
    "Describe the basic components of a neural network and how it can be trained.",
]


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vllm-port") / "model")


@pytest.fixture(scope="package")
def llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256, seed=0)


@pytest.fixture
def example_prompts():
    return list(EXAMPLE_PROMPTS)


@pytest.fixture
def small_llm(model_dir):
    """A second engine for the tests that build their own `LLM` with other arguments (plain torch kernels:
    nothing to compile)."""

    def make(**kwargs):
        return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, attention_backend="torch", **kwargs)

    return make


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_free(request.getfixturevalue("llm").llm_engine)
