"""The lean pooling forward's GEMMs on CPU: oneDNN with each weight packed once into its blocked
layout. Still float32 math (oneDNN's fp32 precision left at IEEE; with anything else set, the
default GEMM runs). Measured on the AMD EPYC (AVX-512) these benchmarks run on: ~2.3x the
throughput of torch's default float32 GEMM (MKL's sgemm, which takes its AVX2 code there), for
128 to 2048 rows, and every row equal bit for bit whatever the row count from 2 up.

A packed weight is a second copy of the weight, held per Linear module in a weak map (it goes
with the model) and packed again if the weight is replaced or changed in place. Where torch has no
oneDNN, or off CPU, the module itself runs."""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger(__name__)

# Off: the modules' own GEMMs (for comparison: bench.embeddings --no-onednn).
ONEDNN = True

_ROWS_HINT = 1024  # the GEMM size oneDNN picks its packing for (pooling_forward.CPU_GROUP_TOKENS)
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weight, its version, packed)


def _usable(x: torch.Tensor) -> bool:
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return (ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and getattr(matmul, "fp32_precision", "none") in ("none", "ieee"))


def linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, through oneDNN with the packed weight where it can."""
    global ONEDNN
    if not _usable(x):
        return module(x)
    weight = module.weight
    entry = _packed.get(module)
    try:
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
            entry = _packed[module] = (weight, weight._version, packed)
        return torch.ops.mkldnn._linear_pointwise(x, entry[2], module.bias, "none", [], "")
    except (RuntimeError, TypeError) as exc:  # private ops: a torch that changed them runs the default GEMM
        log.warning("oneDNN linear unavailable (%s); pooling GEMMs run through torch's default", exc)
        ONEDNN = False
        return module(x)
