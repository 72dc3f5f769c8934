"""Greedy outputs of our engine equal transformers' `generate` token for token."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.hf.config import ModelConfig
from tests.helpers import assert_pool_free, assert_same, make_prompts, reference

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def run_engine(path, prompts, max_tokens, **engine_kwargs):
    llm = LLM(str(path), **engine_kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)
    _, ours = run_engine(path, prompts, max_tokens)
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)
    llm, ours = run_engine(path, prompts, max_tokens, max_num_batched_tokens=48)
    assert_same(ours, reference(path, prompts, max_tokens))
    assert llm.llm_engine.stats["steps"] >= sum(len(p) for p in prompts) // 48


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)
    # Mistral's every layer is windowed (24): it holds a window's blocks, and needs a smaller pool to preempt
    llm, ours = run_engine(path, prompts, max_tokens, num_kv_blocks=24 if arch == "mistral" else 40)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_matches(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    expected = reference(path, prompts, max_tokens)
    llm = LLM(str(path), max_num_batched_tokens=256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    assert_same([o.outputs[0].token_ids for o in first], expected)
    assert_same([o.outputs[0].token_ids for o in again], expected)
    # The budget admits a few prompts a step, so later ones already find shared prefixes...
    assert sum(o.num_cached_tokens for o in first) > 0
    # ...and on the second pass every prompt of a block or more is served from the cache.
    assert all(o.num_cached_tokens >= (len(p) - 1) // 16 * 16 for o, p in zip(again, prompts))


def test_prefix_shared_within_one_step_matches(tiny_model):
    """All prompts admitted in the first step: those after the first of each shared prefix
    already reuse its blocks, written earlier in the same forward pass."""
    path = tiny_model("llama")
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    llm = LLM(str(path), max_num_batched_tokens=8192)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    assert_same([o.outputs[0].token_ids for o in outs], reference(path, prompts, max_tokens))
    # prefixes of 40, 100 and 200 tokens, in turn: the first three prompts computed theirs
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        prefix = (40, 100, 200)[i % 3]
        want = 0 if i < 3 else min(prefix // 16, (len(prompt) - 1) // 16) * 16
        assert out.num_cached_tokens >= want, (i, out.num_cached_tokens, want)
    assert sum(o.num_cached_tokens for o in outs[3:]) > 0


def test_everything_at_once_matches(tiny_model):
    """Prefix caching, chunked prefill and preemption all active in one run."""
    path = tiny_model("qwen3")
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    llm, ours = run_engine(path, prompts, max_tokens, num_kv_blocks=40, max_num_batched_tokens=64)
    assert llm.llm_engine.stats["preemptions"] > 0
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {"num_key_value_heads": 1}),  # MQA
        ("llama", {"num_key_value_heads": 4}),  # MHA
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"attention_bias": True}),
    ],
    ids=["mqa", "mha", "tied", "qwen3-mqa-tied", "llama3-rope", "attention-bias"],
)
def test_variants_match(tiny_model, arch, overrides):
    path = tiny_model(arch, **overrides)
    prompts, max_tokens = make_prompts(seed=3, count=16)
    _, ours = run_engine(path, prompts, max_tokens, max_num_batched_tokens=128)
    assert_same(ours, reference(path, prompts, max_tokens))


def test_legacy_rope_scaling_key_and_sharded_checkpoint(tiny_model, tmp_path):
    """A transformers-4 style config (`rope_scaling` + `rope_theta`) and a sharded
    safetensors checkpoint load to the same model."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    src = tiny_model("llama", rope_parameters=rope)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    for f in src.glob("tokenizer*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded = ModelConfig.load(tmp_path)
    assert loaded.rope_theta == 500000.0 and loaded.rope_scaling["rope_type"] == "llama3"
    prompts, max_tokens = make_prompts(seed=4, count=16)
    _, ours = run_engine(tmp_path, prompts, max_tokens)
    assert_same(ours, reference(src, prompts, max_tokens))
