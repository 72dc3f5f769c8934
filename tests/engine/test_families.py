"""The dense families beyond Llama (Gemma 2/3, Phi-3/4, OLMo 2, Granite, and the text model of the
Gemma 3 and Mistral 3 image-text checkpoints) against transformers' eager attention, token for token
in float32: prompts longer than the sliding windows, chunked prefill with a budget of 32 tokens,
preemption in a tiny KV pool and prefix-cache hits; bfloat16 logprobs within bfloat16's tolerance.
The tiny configs (engine.testing.tiny) set windows of 12-24 tokens, soft caps, local/global RoPE bases with
linear scaling, partial rotary with LongRoPE, and Granite's multipliers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from engine import LLM, SamplingParams
from engine.hf.config import ModelConfig
from tests.helpers import assert_pool_free, assert_same, hf_greedy, make_prompts

FAMILIES = ["gemma2", "gemma3", "gemma3-mm", "phi3", "olmo2", "granite", "mistral3"]
MULTIMODAL = ("gemma3-mm", "mistral3")
_cache: dict = {}


def hf_model(path, arch, dtype=torch.float32):
    auto = AutoModelForImageTextToText if arch in MULTIMODAL else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # our side runs with ignore_eos
    return model


def reference(path, arch, prompts, max_tokens):
    key = (str(path), tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _cache:
        _cache[key] = hf_greedy(hf_model(path, arch), prompts, max_tokens)
    return _cache[key]


def generate(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_greedy_matches_transformers(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)  # up to 300 tokens: far past every window
    llm = LLM(str(path))
    ours = [o.outputs[0].token_ids for o in generate(llm, prompts, max_tokens)]
    assert_pool_free(llm.llm_engine)
    assert_same(ours, reference(path, arch, prompts, max_tokens))


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_chunked_preempted_and_prefix_cached(tiny_model, arch):
    """A token budget of 32 and a pool of 40 blocks (preemptions), prompts sharing prefixes of 40-200
    tokens: the second pass is served from the prefix cache."""
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    expected = reference(path, arch, prompts, max_tokens)
    # Mistral 3's and the tiny Phi-3's every layer is windowed: a sequence holds a window's blocks
    # (engine.core.block_manager), so a smaller pool makes them preempt; the tiny Phi-3 (window 20) gets no
    # second-pass cache hit in any pool small enough to preempt, so it checks each in a pool of its own
    pools = {"mistral3": (14,), "phi3": (20, 30)}.get(arch, (40,))
    llms = []
    for blocks in pools:
        llm = LLM(str(path), max_num_batched_tokens=32, num_kv_blocks=blocks)
        first = generate(llm, prompts, max_tokens)
        again = generate(llm, prompts, max_tokens)
        assert_pool_free(llm.llm_engine)
        assert_same([o.outputs[0].token_ids for o in first], expected)
        assert_same([o.outputs[0].token_ids for o in again], expected)
        llms.append((llm.llm_engine.stats["preemptions"], sum(o.num_cached_tokens for o in again)))
    assert llms[0][0] > 0  # preempted in the smallest pool
    assert llms[-1][1] > 0  # the second pass served from the prefix cache


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_family_triton_kernels_match(tiny_model, arch):
    """The Triton kernel set (the interpreter on CPU) runs the windowed, soft-capped layers alike."""
    pytest.importorskip("triton")
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=4, count=6)
    prompts, max_tokens = [p[:40] for p in prompts], [min(n, 6) for n in max_tokens]
    llm = LLM(str(path), attention_backend="triton", max_num_batched_tokens=32)
    ours = [o.outputs[0].token_ids for o in generate(llm, prompts, max_tokens)]
    assert_same(ours, reference(path, arch, prompts, max_tokens))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "olmo2", "granite"])
def test_family_bfloat16_logprobs_within_tolerance(tiny_model, arch):
    """The first token's top logprobs in bfloat16 against transformers' float32 log-softmax."""
    path = tiny_model(arch)
    prompts, _ = make_prompts(seed=5, count=6)
    llm = LLM(str(path), dtype="bfloat16")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    )
    model = hf_model(path, arch)
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        for token, lp in out.outputs[0].logprobs[0].items():
            worst = max(worst, abs(lp.logprob - expected[token].item()))
    assert worst < 0.1, worst


def test_family_configs_read_as_transformers_builds_them(tiny_model):
    gemma2 = ModelConfig.load(tiny_model("gemma2"))
    assert gemma2.layer_windows == (12, None, 12) and gemma2.attn_softcap == 5.0 and gemma2.final_softcap == 3.0
    assert gemma2.attn_scale == pytest.approx(24**-0.5) and gemma2.norm_layout == "sandwich"
    gemma3 = ModelConfig.load(tiny_model("gemma3-mm"))
    assert gemma3.architecture == "gemma3" and gemma3.rope_scaling["rope_type"] == "linear"
    assert gemma3.local_rope == {"rope_theta": 10000.0, "rope_type": "default"} and gemma3.rope_theta == 1e6
    phi3 = ModelConfig.load(tiny_model("phi3"))
    assert phi3.rotary_dim == 8 and phi3.rope_scaling["rope_type"] == "longrope"
    assert ModelConfig.load(tiny_model("olmo2")).qk_norm_scope == "all"
    assert ModelConfig.load(tiny_model("mistral3")).layer_windows == (24, 24)


def test_unsupported_activation_and_rope_are_refused(tiny_model, tmp_path):
    path = tiny_model("llama")
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        ModelConfig.load(path, overrides={"hidden_act": "relu"})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        ModelConfig.load(path, overrides={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    assert ModelConfig.load(path, overrides={"hidden_act": "gelu_pytorch_tanh"}).hidden_act == "gelu_tanh"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ],
    ids=["yarn", "linear"],
)
def test_rope_scalings_match(tiny_model, rope):
    path = tiny_model("llama", rope_parameters=rope)
    prompts, max_tokens = make_prompts(seed=3, count=8)
    llm = LLM(str(path), max_num_batched_tokens=64)
    assert_same(
        [o.outputs[0].token_ids for o in generate(llm, prompts, max_tokens)],
        reference(path, "llama", prompts, max_tokens),
    )


def test_multimodal_checkpoint_in_transformers_5_layout_loads_alike(tiny_model, tmp_path):
    """The same Gemma 3 image-text weights under transformers 5's names (`model.language_model.*`,
    `model.vision_tower.*`) load to the same text model; the vision tower is skipped either way."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tiny_model("gemma3-mm")
    renamed = tmp_path / "v5"
    shutil.copytree(path, renamed)
    tensors = load_file(str(path / "model.safetensors"))
    v5 = {}
    for name, tensor in tensors.items():
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        v5[name] = tensor
    assert any(n.startswith("model.vision_tower.") for n in v5) and not any(n.startswith("language_model.") for n in v5)
    save_file(v5, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    prompts, max_tokens = make_prompts(seed=6, count=6)
    expected = [o.outputs[0].token_ids for o in generate(LLM(str(path)), prompts, max_tokens)]
    assert [o.outputs[0].token_ids for o in generate(LLM(str(renamed)), prompts, max_tokens)] == expected
