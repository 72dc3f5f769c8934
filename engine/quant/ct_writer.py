"""Write compressed-tensors checkpoints of a dense model directory with the `compressed-tensors`
library's own schemes and compressors (what llmcompressor saves, without its calibration): weight
scales from each weight's min/max (round to nearest), for tests and benchmarks."""

from __future__ import annotations

import shutil
from pathlib import Path

SCHEMES = ("FP8_WEIGHT", "FP8_DYNAMIC", "W4A16", "W4A16_ASYM", "W8A16")


def write_compressed_tensors(src, out, scheme: str, group_size: int = 32) -> Path:
    """`src` (a float checkpoint) quantized with `scheme` into `out`: FP8_WEIGHT is FP8 weights per
    channel alone, the others compressed-tensors' presets (integer ones with `group_size`)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {SCHEMES}")
    src, out = Path(src), Path(out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if scheme == "FP8_WEIGHT":
        preset = QuantizationScheme(targets=["Linear"], weights=preset_name_to_scheme("FP8_DYNAMIC", []).weights)
    else:
        preset = preset_name_to_scheme(scheme, ["Linear"])
    if preset.weights.group_size:
        preset.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": preset}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            if args.strategy == "group":
                pieces = w.unflatten(-1, (-1, args.group_size))
                lo, hi = pieces.amin(-1), pieces.amax(-1)
            else:  # channel
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists():  # tokenizer files
            shutil.copy(f, out / f.name)
    return out
