"""The engine on the Triton kernels (through the interpreter on CPU) still matches
transformers' greedy output token for token."""

import pytest

from engine import LLM, SamplingParams
from tests.helpers import assert_pool_free, assert_same, make_prompts, reference

pytestmark = pytest.mark.slow  # whole models through the Triton interpreter on CPU


@pytest.mark.parametrize(
    "arch,engine_kwargs",
    [
        ("qwen3", {"max_num_batched_tokens": 64, "num_kv_blocks": 24}),  # chunked + preemption
        ("llama", {"max_num_batched_tokens": 96}),  # GQA, prefix caching on shared prefixes
    ],
)
def test_triton_backend_matches_transformers(tiny_model, arch, engine_kwargs):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=5, count=8, shared_prefixes=arch == "llama")
    prompts = [p[:120] for p in prompts]
    max_tokens = [min(n, 8) for n in max_tokens]
    llm = LLM(str(path), attention_backend="triton", **engine_kwargs)
    assert llm.llm_engine.runner.ops.name == "triton"
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    assert_same([o.outputs[0].token_ids for o in outs], reference(path, prompts, max_tokens))
    if "num_kv_blocks" in engine_kwargs:
        assert llm.llm_engine.stats["preemptions"] > 0
