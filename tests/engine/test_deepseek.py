"""DeepSeek V2/V3 against transformers: the grouped routers on their own, the latent-attention KV
cache's size (one entry of kv_lora_rank + qk_rope_head_dim per token and layer), greedy float32
output token for token (with prefix-cache hits, chunked prefill at a 32-token budget and
preemption, on the compiled CPU kernels and the torch reference), config variants, bfloat16 prompt
logprobs within tolerance, and the tiny-model writer."""

import json

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.hf.config import ModelConfig
from engine.models.deepseek import grouped_route
from tests.helpers import (
    assert_bf16_prompt_logprobs_close,
    assert_exact_under_pressure,
    assert_pool_free,
    assert_same,
    chat_prompt_as_transformers,
    make_prompts,
    reference,
)

ARCHS = ["deepseek_v2", "deepseek_v3"]


def _run(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outs, [o.outputs[0].token_ids for o in outs]


# ---- the routers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
        ("deepseek_v2", {"topk_method": "greedy", "n_group": None, "topk_group": None}),
        ("deepseek_v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True}),
        ("deepseek_v3", {"n_group": 2, "topk_group": 1, "norm_topk_prob": False}),
    ],
    ids=["v2-group-limited", "v2-greedy", "v3-groups-normalised", "v3-one-group-of-two"],
)
def test_router_is_transformers_router(arch, overrides):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.testing.tiny import tiny_config

    config = tiny_config(arch, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=1.7, **overrides)
    router = (DeepseekV2TopkRouter if arch == "deepseek_v2" else DeepseekV3TopkRouter)(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        bias.copy_(torch.randn(16) * 0.3)
    x = torch.randn(50, 64)
    _, want_weights, want_ids = router(x)
    architecture = "DeepseekV2ForCausalLM" if arch == "deepseek_v2" else "DeepseekV3ForCausalLM"
    cfg = ModelConfig.from_dict({**config.to_dict(), "architectures": [architecture]}, path=None)
    weights, ids = grouped_route(F.linear(x, router.weight), cfg.moe, bias)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


# ---- the compressed cache -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_holds_one_latent_entry_per_token(tiny_model, arch):
    """(kv_lora_rank + qk_rope_head_dim) * layers * dtype size per token: one pool per layer, read
    as both keys and values; no per-head K or V."""
    path = tiny_model(arch)
    raw = json.loads((path / "config.json").read_text())
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=8, attention_backend="torch")
    runner = llm.llm_engine.runner
    width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    per_token = width * raw["num_hidden_layers"] * torch.bfloat16.itemsize
    assert runner._bytes_per_block() == per_token * runner.block_size
    pools = runner.kv_caches
    assert len(pools) == raw["num_hidden_layers"] and all(k is v for k, v in pools)
    assert sum(k.numel() * k.element_size() for k, _ in pools) == per_token * runner.block_size * runner.num_blocks
    assert pools[0][0].shape == (8, runner.block_size, 1, width)
    cfg = runner.model_config
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_tensors_per_layer) == (1, width, 1)


def test_config_reads_the_deepseek_settings(tiny_model):
    v3 = ModelConfig.load(tiny_model("deepseek_v3"))
    assert v3.moe.sparse_layers == {1, 2} and v3.moe.norm_topk_prob and v3.moe.routed_scaling_factor == 2.5
    assert (v3.moe.routing.scoring, v3.moe.routing.n_group, v3.moe.routing.topk_group) == ("sigmoid", 4, 2)
    assert v3.moe.shared_expert_intermediate_size == 32 and v3.mla.q_lora_rank == 24
    # YaRN's mscale_all_dim scales the whole score: (0.1 * 0.8 * ln 4 + 1) ** 2 / sqrt(32)
    assert v3.attn_scale == pytest.approx((0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1) ** 2 / 32**0.5)
    v2 = ModelConfig.load(tiny_model("deepseek_v2"))
    assert v2.moe.routing.scoring == "softmax" and not v2.moe.norm_topk_prob and v2.mla.q_lora_rank is None
    assert v2.attn_scale == pytest.approx(32**-0.5)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot split deepseek_v2: its latent attention"):
        from engine.parallel.sharding import check_shardable

        check_shardable(v2, 2)


# ---- the engine against transformers ------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_model, arch, backend):
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=1)
    llm = LLM(str(path), attention_backend=backend)
    _, ours = _run(llm, prompts, max_tokens)
    assert_pool_free(llm.llm_engine)
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_chunked_prefill_and_preemption_match(tiny_model, arch):
    """A 32-token budget and a pool too small for the batch; the second pass reads the prefixes'
    latent entries from the cache."""
    path = tiny_model(arch)
    prompts, max_tokens = make_prompts(seed=2, shared_prefixes=True)
    first, again = assert_exact_under_pressure(path, prompts, max_tokens, reference(path, prompts, max_tokens))
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("deepseek_v3", {"rope_interleave": False, "q_lora_rank": None, "norm_topk_prob": False}),
        ("deepseek_v3", {"attention_bias": True, "first_k_dense_replace": 0, "n_shared_experts": 2}),
        ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": 16, "attention_bias": True}),
    ],
    ids=["v3-halves-rope-no-q-lora", "v3-bias-all-sparse", "v2-greedy-q-lora"],
)
def test_variants_match(tiny_model, arch, overrides):
    path = tiny_model(arch, **overrides)
    prompts, max_tokens = make_prompts(seed=3, count=10)
    _, ours = _run(LLM(str(path), max_num_batched_tokens=128), prompts, max_tokens)
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_prompt_logprobs_within_tolerance(tiny_model, arch):
    """bfloat16 weights, activations and latent cache against transformers' float32, with the
    tolerance of the other MoE families (the router stays float32, yet bfloat16 activations flip
    its choice at a few positions)."""
    path = tiny_model(arch)
    llm = LLM(str(path), dtype="bfloat16", max_num_batched_tokens=64)
    gate = llm.llm_engine.runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32  # as transformers keeps it
    assert_bf16_prompt_logprobs_close(path, llm)


@pytest.mark.parametrize(
    "arch,architecture", [("deepseek_v2", "DeepseekV2ForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")]
)
def test_cli_tiny_model_writes_each_family(tmp_path, capsys, arch, architecture):
    from safetensors import safe_open

    from pagedbatch.cli import main

    path = tmp_path / arch
    assert main(["tiny-model", str(path), "--arch", arch]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == [architecture]
    cfg = ModelConfig.load(path)
    assert cfg.mla is not None and cfg.moe.routing is not None
    if arch == "deepseek_v3":  # a bias that steers the choice, not transformers' zeros
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").abs().min() > 0


def test_multi_token_prediction_layer_is_skipped(tiny_model, tmp_path):
    """V3 checkpoints carry a next-token-prediction layer past num_hidden_layers (model.layers.61 in
    DeepSeek-V3); it is not loaded, as transformers does not load it."""
    from safetensors.torch import load_file, save_file

    src = tiny_model("deepseek_v3")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.randn(160, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    prompts, max_tokens = [[5, 6, 7, 8, 9]], [4]
    _, ours = _run(LLM(str(tmp_path), attention_backend="torch"), prompts, max_tokens)
    _, want = _run(LLM(str(src), attention_backend="torch"), prompts, max_tokens)
    assert ours == want


def test_docs_table_lists_every_supported_architecture():
    from engine.hf.config import SUPPORTED_ARCHITECTURES
    from tests.helpers import REPO

    rows = [line for line in (REPO / "docs" / "engine.md").read_text().splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in row.split("|")[1].replace("`", "").replace(",", " ").split()}
    assert set(SUPPORTED_ARCHITECTURES) <= listed, set(SUPPORTED_ARCHITECTURES) - listed


@pytest.mark.slow  # a whole model through the Triton interpreter on CPU
def test_triton_backend_matches_transformers(tiny_model):
    """The Triton set: its paged attention over the latent entries (a width of 48, not a power of
    two) and the fused experts kernel behind the grouped router."""
    path = tiny_model("deepseek_v3")
    prompts, max_tokens = make_prompts(seed=6, count=6, shared_prefixes=True)
    prompts, max_tokens = [p[:60] for p in prompts], [min(n, 6) for n in max_tokens]
    llm = LLM(str(path), attention_backend="triton", max_num_batched_tokens=32, num_kv_blocks=12)
    assert llm.llm_engine.runner.ops.fused_moe is not None
    _, ours = _run(llm, prompts, max_tokens)
    assert_pool_free(llm.llm_engine)
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_as_transformers(tiny_model, arch):
    path = tiny_model(arch)
    text = chat_prompt_as_transformers(path, attention_backend="torch")
    assert text == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello!<｜Assistant｜>Hi.<｜end▁of▁sentence｜>"
        "<｜User｜>How are you?<｜Assistant｜>"
    )
