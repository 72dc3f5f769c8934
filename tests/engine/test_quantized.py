"""Quantized checkpoints through the engine: compressed-tensors FP8 (weight-only per channel) and W4A16
(group 32) equal transformers (which decompresses them) token for token; dynamic-activation FP8 equals
its quantize-dequantize reference; AWQ, GPTQ and fine-grained FP8 written by our own packers equal the
dense dequantized model; weights stay quantized in memory; unsupported schemes are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant.config import UnsupportedQuantization
from engine.quant.ct_writer import write_compressed_tensors
from engine.quant.linear import QuantLinear
from engine.quant.packers import write_packed
from tests.helpers import assert_pool_free, assert_same, make_prompts, reference

pytest.importorskip("compressed_tensors", reason="the dev extra's compressed-tensors writes the checkpoints")


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    made = {}

    def make(kind: str, arch: str = "llama", **kw):
        key = (kind, arch, tuple(sorted(kw.items())))
        if key not in made:
            src = tiny_model(arch)
            out = tmp_path_factory.mktemp(f"q-{kind}")
            if kind in ("awq", "gptq", "fp8"):
                made[key] = write_packed(src, out / "q", out / "dense", kind, **kw)
            else:
                made[key] = write_compressed_tensors(src, out, kind, **kw)
        return made[key]

    return make


def _generate(path, prompts, max_tokens, **kwargs):
    llm = LLM(str(path), dtype="float32", **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_pool_free(llm.llm_engine)
    return llm, [o.outputs[0].token_ids for o in outs]


def _quant_layers(llm):
    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize(
    "scheme,arch", [("FP8_WEIGHT", "llama"), ("W4A16", "llama"), ("W4A16", "qwen2"), ("W8A16", "qwen3")]
)
def test_compressed_tensors_matches_transformers(checkpoints, scheme, arch):
    path = checkpoints(scheme, arch)
    prompts, max_tokens = make_prompts(seed=1, count=8)
    llm, ours = _generate(path, prompts, max_tokens, max_num_batched_tokens=64, num_kv_blocks=48)
    assert llm.llm_engine.stats["preemptions"] > 0  # chunked prefill and preemption on the way
    assert_same(ours, reference(path, prompts, max_tokens))
    layers = _quant_layers(llm)
    assert len(layers) == 4 * llm.llm_engine.model_config.num_layers  # qkv, o, gate_up, down
    wanted = torch.float8_e4m3fn if scheme.startswith("FP8") else torch.uint8
    assert all(layer.qweight.dtype == wanted for layer in layers)
    if scheme.startswith("W4"):  # two codes a byte, scales per group of 32
        assert all(layer.qweight.shape[1] * 2 == layer.in_features and layer.group_size == 32 for layer in layers)


def test_prefix_caching_on_a_quantized_model(checkpoints):
    path = checkpoints("W4A16")
    prompts, max_tokens = make_prompts(seed=2, count=8, shared_prefixes=True)
    llm, first = _generate(path, prompts, max_tokens, max_num_batched_tokens=256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert sum(o.num_cached_tokens for o in again) > 0
    expected = reference(path, prompts, max_tokens)
    assert_same(first, expected)
    assert_same([o.outputs[0].token_ids for o in again], expected)


def test_dynamic_fp8_activations_match_quantize_dequantize_reference(checkpoints):
    """FP8_DYNAMIC (W8A8-FP8): every quantized layer's output equals dequant(quant(x)) @ dequant(W).T with
    x quantized per token, written out here; and whole greedy runs equal transformers' (compressed-tensors
    fake-quantizes the activations the same way)."""
    path = checkpoints("FP8_DYNAMIC")
    llm = LLM(str(path), dtype="float32")
    layers = _quant_layers(llm)
    assert layers and all(layer.scheme.act_dynamic for layer in layers)
    x = torch.randn(7, layers[0].in_features) * 3
    for layer in layers[:2]:
        scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
        x_deq = (x / scale).to(torch.float8_e4m3fn).float() * scale
        w_deq = layer.qweight.float() * layer.scales
        torch.testing.assert_close(layer(x), x_deq @ w_deq.T, rtol=1e-5, atol=1e-5)
        dense = x @ w_deq.T
        assert not torch.allclose(layer(x), dense, rtol=1e-6, atol=1e-6)  # the activations really are rounded
    prompts, max_tokens = make_prompts(seed=3, count=6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert_same(ours, reference(path, prompts, max_tokens))


@pytest.mark.parametrize(
    "method,kw", [("awq", {}), ("gptq", {}), ("gptq", {"act_order": True}), ("gptq", {"v1": False}), ("fp8", {})]
)
def test_own_packers_match_dense_dequantized_model(checkpoints, method, kw):
    """AWQ/GPTQ (4-bit, group 32, asymmetric) and fine-grained FP8 (32x32 blocks) written by our packers:
    logits equal those of the dense checkpoint holding the dequantized weights. (Fine-grained FP8 also
    quantizes activations, so its logits are only close and its tokens not compared.)"""
    quantized, dense = checkpoints(method, **kw)
    prompts, max_tokens = make_prompts(seed=4, count=6)
    q_llm, q_tokens = _generate(quantized, prompts, max_tokens)
    d_llm, d_tokens = _generate(dense, prompts, max_tokens)
    assert _quant_layers(q_llm) and not _quant_layers(d_llm)
    q_logits, d_logits = (_logits(llm, prompts[4]) for llm in (q_llm, d_llm))
    if method == "fp8":
        assert (q_logits - d_logits).abs().max() < 0.05 * d_logits.abs().max()
        return
    torch.testing.assert_close(q_logits, d_logits, rtol=1e-4, atol=1e-4)
    assert_same(q_tokens, d_tokens)
    if kw.get("act_order"):
        assert all(layer.g_idx is not None for layer in _quant_layers(q_llm))


def _logits(llm, prompt):
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20, ignore_eos=True)
    )
    return torch.tensor(sorted(lp.logprob for lp in out[0].outputs[0].logprobs[0].values()))


def test_online_fp8_quantizes_a_dense_checkpoint(tiny_model):
    path = tiny_model("llama")
    llm = LLM(str(path), dtype="float32", quantization="fp8")
    layers = _quant_layers(llm)
    assert layers and all(layer.qweight.dtype == torch.float8_e4m3fn for layer in layers)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def _with_quant_config(tiny_model, tmp_path, qc):
    src = tiny_model("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return tmp_path


@pytest.mark.parametrize(
    "qc,words",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 3, "group_size": 32}, "awq bits=3"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                    }
                },
            },
            "compressed-tensors group",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                    }
                },
            },
            "input activations",
        ),
    ],
)
def test_unsupported_schemes_are_refused_with_the_supported_list(tiny_model, tmp_path, qc, words):
    path = _with_quant_config(tiny_model, tmp_path, qc)
    with pytest.raises(UnsupportedQuantization) as err:
        LLM(str(path), dtype="float32")
    assert words in str(err.value) and "Supported: compressed-tensors" in str(err.value)


def test_requested_method_must_match_the_checkpoint(checkpoints, tiny_model):
    with pytest.raises(ValueError, match="does not match the checkpoint's quant_method 'compressed-tensors'"):
        LLM(str(checkpoints("W4A16")), dtype="float32", quantization="awq")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        LLM(str(tiny_model("llama")), dtype="float32", quantization="gptq")
    with pytest.raises(ValueError, match="unsupported quantization: quantization='int3'"):
        LLM(str(tiny_model("llama")), dtype="float32", quantization="int3")


MEMORY_MODEL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6)


@pytest.mark.parametrize("scheme,limit", [("FP8_WEIGHT", 0.55), ("W4A16", 0.35)])
def test_resident_weights_shrink_against_bfloat16(tiny_model, tmp_path, scheme, limit):
    """The engine's parameter and weight-buffer bytes (bfloat16 activations) against the bf16 model's."""
    src = tiny_model("llama", **MEMORY_MODEL)
    path = write_compressed_tensors(src, tmp_path / scheme, scheme)
    dense = LLM(str(src), dtype="bfloat16", num_kv_blocks=8).llm_engine.runner.weight_bytes
    llm = LLM(str(path), dtype="bfloat16", num_kv_blocks=8)
    quantized = llm.llm_engine.runner.weight_bytes
    ratio = quantized / dense
    print(f"{scheme}: {quantized / 2**20:.2f} MiB vs bf16 {dense / 2**20:.2f} MiB = {ratio:.3f}x")
    assert ratio <= limit
    for layer in _quant_layers(llm):  # scales in bf16 (the W4A16 ones as the int4 CPU GEMM's scale/zero pairs)
        assert (layer.scales if layer.scales is not None else layer.scale_zeros).dtype == torch.bfloat16
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_WEIGHT"])
def test_triton_kernel_set_runs_the_quantized_gemm(checkpoints, scheme):
    """With the Triton kernel set (the interpreter on CPU) every quantized layer multiplies through the
    Triton GEMM, and the greedy output still equals transformers'."""
    from pagedbatch_kernels.lora_quant.quant_matmul import quant_matmul

    path = checkpoints(scheme)
    prompts, max_tokens = make_prompts(seed=5, count=3)
    prompts, max_tokens = [p[:40] for p in prompts], [min(n, 6) for n in max_tokens]
    llm, ours = _generate(path, prompts, max_tokens, attention_backend="triton")
    assert all(layer.kernel is quant_matmul for layer in _quant_layers(llm))
    assert_same(ours, reference(path, prompts, max_tokens))


def test_startup_log_names_weights_and_kv_blocks(checkpoints, caplog):
    with caplog.at_level("INFO", logger="engine.runner.model_runner"):
        LLM(str(checkpoints("W4A16")), dtype="float32", cpu_kv_cache_gb=0.01)
    text = caplog.text
    assert "weights:" in text and "MiB resident (compressed-tensors)" in text
    assert "KV pool:" in text and " blocks of 16 tokens" in text
