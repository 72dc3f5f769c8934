"""quantization_config as vLLM reads it: which layers a scheme covers, and the schemes of the hub's
config shapes (compressed-tensors presets, fine-grained FP8, AWQ, GPTQ)."""

from __future__ import annotations

import pytest

from engine.quant.config import Scheme, UnsupportedQuantization, detect


def _ct(weights, acts=None, fmt="pack-quantized", ignore=("lm_head",), targets=("Linear",)):
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": list(targets), "weights": weights, "input_activations": acts}},
        }
    }


W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def test_compressed_tensors_schemes():
    assert detect(_ct(W4), None).scheme_for("model.layers.0.mlp.down_proj") == Scheme(False, 4, group_size=128)
    fp8 = detect(_ct(FP8_CHANNEL, FP8_TOKEN, fmt="float-quantized"), None).scheme_for("model.layers.3.self_attn.q_proj")
    assert fp8 == Scheme(True, 8, act_dynamic=True)
    block = {**FP8_CHANNEL, "strategy": "block", "block_structure": [128, 128]}
    group_act = {**FP8_TOKEN, "strategy": "group", "group_size": 128}
    assert detect(_ct(block, group_act, fmt="float-quantized"), None).default is None
    scheme = detect(_ct(block, group_act, fmt="float-quantized"), None).scheme_for("model.layers.0.mlp.up_proj")
    assert (scheme.block_rows, scheme.group_size, scheme.act_group) == (128, 128, 128)


def test_targets_and_ignore_by_name_and_regex():
    qc = detect(_ct(W4, ignore=("lm_head", "re:.*layers\\.1\\..*"), targets=("re:.*mlp.*",)), None)
    assert qc.scheme_for("model.layers.0.mlp.gate_proj") is not None
    assert qc.scheme_for("model.layers.0.self_attn.q_proj") is None  # not a target
    assert qc.scheme_for("model.layers.1.mlp.gate_proj") is None  # ignored
    assert qc.scheme_for("lm_head") is None


def test_awq_gptq_and_fine_grained_fp8():
    awq = detect(
        {
            "quantization_config": {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 128,
                "zero_point": True,
                "version": "GEMM",
            }
        },
        "awq_marlin",
    )
    assert awq.scheme_for("model.layers.0.mlp.up_proj") == Scheme(False, 4, group_size=128, symmetric=False)
    gptq = detect(
        {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": True}},
        None,
    )
    assert gptq.fmt == "gptq" and gptq.default.group_size is None and gptq.default.bits == 8
    fp8 = detect(
        {
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            }
        },
        "fp8",
    )
    assert fp8.default.block_rows == 128 and fp8.default.act_dynamic
    assert detect({}, None) is None
    assert detect({}, "fp8").fmt == "online"


@pytest.mark.parametrize(
    "config",
    [
        _ct({**W4, "num_bits": 2}),
        _ct(W4, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
        {"quantization_config": {"quant_method": "gptq", "bits": 3}},
        {"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}},
        {"quantization_config": {"quant_method": "hqq"}},
    ],
)
def test_refusals_list_what_is_supported(config):
    with pytest.raises(UnsupportedQuantization, match="Supported: compressed-tensors: float 8-bit weights"):
        detect(config, None)
