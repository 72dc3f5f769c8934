"""Windowed and soft-capped models on the CPU engine's native kernels (`cpu_window`) against
transformers' eager attention, token for token in float32: the tiny Gemma 2, Gemma 3 and Mistral
configs with a head size the native kernels take (32; the family tests' 16 runs the reference),
prompts many windows long, chunked prefill with a budget of 32 tokens, preemption in a tiny pool and
prefix-cache hits."""

from __future__ import annotations

import pytest

from engine import LLM
from pagedbatch_kernels.cpu import cpu_attention
from tests.engine.test_families import generate, reference
from tests.helpers import assert_pool_free, assert_same, make_prompts

ARCHS = ["gemma2", "gemma3", "mistral"]


@pytest.fixture
def banded_calls(monkeypatch):
    """The (window, softcap) of every call the engine makes through the native banded kernels."""
    calls = []
    real = cpu_attention.banded_attention

    def spy(*args, window=None, softcap=None):
        calls.append((window, softcap))
        return real(*args, window=window, softcap=softcap)

    monkeypatch.setattr(cpu_attention, "banded_attention", spy)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_native_windows_match_transformers(tiny_model, arch, banded_calls):
    path = tiny_model(arch, head_dim=32)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    expected = reference(path, arch, prompts, max_tokens)
    # Mistral's every layer is windowed: its blocks behind the window are released, so its pool is
    # smaller (14 blocks of 16 tokens, prompts up to 260) for it to preempt
    llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=14 if arch == "mistral" else 40)
    first = generate(llm, prompts, max_tokens)
    again = generate(llm, prompts, max_tokens)
    assert_pool_free(llm.llm_engine)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_same([o.outputs[0].token_ids for o in first], expected)
    assert_same([o.outputs[0].token_ids for o in again], expected)
    windows = {"gemma2": {(12, 5.0), (None, 5.0)}, "gemma3": {(12, None)}, "mistral": {(24, None)}}[arch]
    assert set(banded_calls) == windows


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_native_windows_whole_prompts_match_transformers(tiny_model, arch, banded_calls):
    """Whole prompts of up to 300 tokens in one step (the span kernel over a long band) and batched decodes."""
    path = tiny_model(arch, head_dim=32)
    prompts, max_tokens = make_prompts(seed=1)
    llm = LLM(str(path))
    ours = [o.outputs[0].token_ids for o in generate(llm, prompts, max_tokens)]
    assert_same(ours, reference(path, arch, prompts, max_tokens))
    assert banded_calls
