"""gpt-oss against transformers: the router (bias, softmax over the chosen k), the experts (interleaved
gate/up, clamped SwiGLU, biases) on both CPU paths, MXFP4 dequantisation against transformers' own,
greedy float32 output token for token (prompts far past the sliding window, prefix-cache hits, chunked
prefill at a 32-token budget, preemption), the MXFP4 checkpoint layout, bfloat16 prompt logprobs
within tolerance, and the harmony chat template."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GptOssConfig, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from engine import LLM, SamplingParams
from engine.hf.config import ModelConfig
from engine.models.gpt_oss import clamped_swiglu, deinterleave, route_after_topk
from engine.models.moe import grouped_experts, padded_experts
from engine.quant.mxfp4 import dequantize_mxfp4, pack_mxfp4
from tests.helpers import (
    assert_bf16_prompt_logprobs_close,
    assert_exact_under_pressure,
    assert_pool_free,
    assert_same,
    chat_prompt_as_transformers,
    make_prompts,
    reference,
)

ARCHS = ["gpt_oss", "gpt_oss-mxfp4"]


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(llm, prompts, max_tokens):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(n) for n in max_tokens])
    return outs, [o.outputs[0].token_ids for o in outs]


def _reference(path, arch, prompts, max_tokens):
    """transformers' greedy output; the MXFP4 checkpoint dequantised by transformers itself."""
    load = {"quantization_config": Mxfp4Config(dequantize=True)} if arch == "gpt_oss-mxfp4" else {}
    return reference(path, prompts, max_tokens, **load)


# ---- the block's arithmetic -------------------------------------------------------------------


def _config(**overrides):
    kwargs = dict(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    return GptOssConfig(**{**kwargs, **overrides})


def test_route_is_transformers_router():
    router = GptOssTopKRouter(_config())
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(30, 32)
    _, want_weights, want_ids = router(x)
    weights, ids = route_after_topk(F.linear(x, router.weight, router.bias), 2)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float())


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_experts_equal_transformers_experts(tokens):
    """Both CPU paths (grouped by expert, and the padded batched matmuls) on our layout equal
    transformers' experts on theirs, with the clamp active (limit 0.5)."""
    torch.manual_seed(tokens)
    config = _config(swiglu_limit=0.5)
    theirs = GptOssExperts(config)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(tokens, 32)
    weights, ids = route_after_topk(torch.randn(tokens, 6), 2)
    with torch.no_grad():
        want = theirs(x, ids, weights)
    gate_up = deinterleave(theirs.gate_up_proj.detach().transpose(1, 2), 1)
    biases = (deinterleave(theirs.gate_up_proj_bias.detach(), 1), theirs.down_proj_bias.detach())
    down = theirs.down_proj.detach().transpose(1, 2)

    def act(h):
        return clamped_swiglu(h, config.swiglu_alpha, config.swiglu_limit)

    for path in (grouped_experts, padded_experts):
        got = path(x, gate_up, down, weights, ids, act, biases)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers(dtype):
    """Every code and a spread of scales; transformers returns [E, in, out], we keep [E, out, in]."""
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), want)


def test_mxfp4_packing_round_trips():
    weights = torch.randn(2, 6, 64) * 0.2
    blocks, scales = pack_mxfp4(weights)
    assert blocks.shape == (2, 6, 2, 16) and scales.shape == (2, 6, 2)
    once = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*pack_mxfp4(once)), once)  # representable values stay
    error = (once - weights).abs().view(2, 6, 2, 32)
    group_peak = weights.abs().view(2, 6, 2, 32).amax(-1, keepdim=True)
    assert (error <= group_peak / 3).all()  # at most half the widest step (4 to 6) of each group's scale


def test_config_reads_the_gpt_oss_settings(tiny_model):
    cfg = ModelConfig.load(tiny_model("gpt_oss"))
    assert cfg.architecture == "gpt_oss" and cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.layer_windows == (12, None, 12)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert cfg.moe.gpt_oss and (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.swiglu_limit) == (8, 2, 1.0)
    assert cfg.moe.sparse_layers == {0, 1, 2}


# ---- the engine against transformers ----------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)
    assert max(map(len, prompts)) > 20 * 12  # far past the 12-token window
    llm = LLM(str(path))
    _, ours = _run(llm, prompts, max_tokens)
    assert_pool_free(llm.llm_engine)
    assert_same(ours, _reference(path, arch, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_chunked_prefill_and_preemption_match(tiny_model, arch):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    first, again = assert_exact_under_pressure(path, prompts, max_tokens, _reference(path, arch, prompts, max_tokens))
    assert sum(o.num_cached_tokens for o in first + again) > 0


def test_torch_backend_matches(tiny_model):
    """The plain torch kernel set (no compiled CPU kernels) through the same sink paths."""
    path = tiny_model("gpt_oss")
    prompts, max_tokens = make_prompts(seed=3, count=8)
    _, ours = _run(LLM(str(path), attention_backend="torch", max_num_batched_tokens=64), prompts, max_tokens)
    assert_same(ours, reference(path, prompts, max_tokens))


def test_mxfp4_checkpoint_layout(tiny_model):
    path = tiny_model("gpt_oss-mxfp4")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks").dtype == torch.uint8
    assert "model.layers.0.mlp.experts.down_proj_scales" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names


def test_bfloat16_prompt_logprobs_within_tolerance(tiny_model):
    """As for the other MoE families: bfloat16 against transformers' float32, within 0.03 on average
    and 0.1 at 95% of the positions (bfloat16 flips the router's choice at a few)."""
    path = tiny_model("gpt_oss")
    llm = LLM(str(path), dtype="bfloat16", max_num_batched_tokens=64)
    assert_bf16_prompt_logprobs_close(path, llm)


def test_chat_template_renders_as_transformers(tiny_model):
    path = tiny_model("gpt_oss")
    text = chat_prompt_as_transformers(path)
    assert text.startswith("<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>")
    assert text.endswith("<|start|>user<|message|>How are you?<|end|><|start|>assistant")


def test_tensor_parallel_is_refused(tiny_model):
    from engine.parallel.sharding import check_shardable

    with pytest.raises(ValueError, match="attention sinks"):
        check_shardable(ModelConfig.load(tiny_model("gpt_oss")), 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_cli_tiny_model_writes_gpt_oss(tmp_path, capsys, arch):
    from pagedbatch.cli import main

    path = tmp_path / arch
    assert main(["tiny-model", str(path), "--arch", arch]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    assert ModelConfig.load(path).moe.gpt_oss
