"""A model's linear layers made quantized before its weights load (model construction's hook), the
loader's hook that fills them from the checkpoint's quantized tensors, and the resident weight bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from engine.hf.model_info import read_config
from engine.quant.config import QuantConfig, UnsupportedQuantization, detect
from engine.quant.formats import convert
from engine.quant.linear import QuantLinear

log = logging.getLogger(__name__)


def quantize_model(
    model: nn.Module, path: Path, requested: str | None, dtype: torch.dtype, device: torch.device, kernel=None
) -> QuantConfig | None:
    """Replace the linear layers the checkpoint (or `requested`) quantizes by `QuantLinear`s and give
    the model a `quant_loader` for `engine.loader`; returns the config, None for a dense model.
    `kernel`: the kernel set's quantized GEMM (`Ops.quant_matmul`), None for the torch twin."""
    qc = detect(read_config(path), requested)
    if qc is None:
        return None
    if getattr(model.cfg, "moe", None) is not None:
        raise UnsupportedQuantization("mixture-of-experts models (quantized experts)")
    shards = {}  # our fused name -> its checkpoint parts, in order
    for part, (packed_name, index) in model.packed.items():
        shards.setdefault(packed_name, {})[index] = part
    layers = {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or (child_name == "lm_head" and model.cfg.tie_word_embeddings):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            parts = shards.get(child_name)
            names = [name.replace(child_name, p) for _, p in sorted(parts.items())] if parts else [name]
            schemes = {qc.scheme_for(n) for n in names}
            if len(schemes) > 1:
                raise UnsupportedQuantization(f"differently quantized parts of one fused layer: {names}")
            scheme = schemes.pop()
            if scheme is None:
                continue
            layer = QuantLinear(
                child.in_features, child.out_features, child.bias is not None, scheme, dtype, device, kernel
            )
            setattr(parent, child_name, layer)
            layers[name] = layer
    if not layers:
        raise UnsupportedQuantization(f"{qc.method} config that quantizes no linear layer of this model")
    model.quant_loader = QuantLoader(model, qc, layers)
    log.info("quantization: %s (%s), %d linear layers quantized", qc.method, qc.fmt, len(layers))
    return qc


class QuantLoader:
    """Takes the checkpoint tensors of quantized layers (`take`), leaves every other one to the loader."""

    def __init__(self, model: nn.Module, qc: QuantConfig, layers: dict[str, QuantLinear]):
        self.model, self.qc, self.layers = model, qc, layers

    def take(self, name: str, get_tensor) -> bool:
        prefix, _, suffix = name.rpartition(".")
        target, start, rows = prefix, 0, None
        for part, (packed_name, index) in self.model.packed.items():
            if prefix.endswith(f".{part}"):
                target = prefix[: -len(part)] + packed_name
                sizes = self.model.shard_sizes(packed_name)
                start, rows = sum(sizes[:index]), sizes[index]
                break
        layer = self.layers.get(target)
        if layer is None:
            return False
        rows = layer.out_features if rows is None else rows
        pieces = convert(self.qc, layer.scheme, suffix, get_tensor(), rows)
        if pieces is None:
            return False
        for piece, tensor in pieces:
            try:
                layer.load_rows(piece, tensor, start, rows)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        return True

    def check_complete(self) -> None:
        missing = [f"{name}.{part}" for name, layer in self.layers.items() for part in layer.missing()]
        if missing:
            raise ValueError(f"quantized checkpoint is missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        packed = sum(layer.pack_for_cpu() for layer in self.layers.values())
        if packed:
            log.info("quantization: %d 4-bit layers on PyTorch's int4 CPU GEMM", packed)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and weight buffers (quantized weights, scales), each storage once;
    the RoPE tables are not weights."""
    seen, total = set(), 0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "cos_sin" not in n]
    for _, tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
