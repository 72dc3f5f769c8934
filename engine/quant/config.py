"""What a checkpoint's `quantization_config` (or `LLM(quantization=...)`) asks for, as vLLM reads it:
compressed-tensors (FP8 weights per channel, tensor or block, with or without dynamic FP8 activations;
4/8-bit integer weights per group or channel, packed or naive), transformers' fine-grained `fp8`
(block-wise `weight_scale_inv`), AWQ and GPTQ (int32-packed `qweight`/`qzeros`/`scales`[/`g_idx`]),
and `quantization="fp8"` over a dense checkpoint (weights quantized at load); gpt-oss's MXFP4 experts
are dequantised at load (no quantized layers here). Anything else is refused
at load with the list of what is supported. Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SUPPORTED = (
    "compressed-tensors: float 8-bit weights (channel, tensor or block scales) with no or dynamic per-token "
    "(or per-group) FP8 activations (FP8, FP8_DYNAMIC/W8A8-FP8, FP8_BLOCK); int 4/8-bit weights per group or "
    "channel, symmetric or not, pack-quantized or naive-quantized (W4A16, W8A16, W4A16_ASYM)",
    "fp8: transformers' fine-grained FP8 (weight_scale_inv per block, dynamic activations)",
    "awq: 4-bit GEMM layout with zero points",
    "gptq: 4 or 8-bit, desc_act (g_idx) or not, symmetric or not",
    "quantization='fp8' over an unquantized checkpoint: FP8 weights per channel, quantized at load",
)
METHODS = ("compressed-tensors", "fp8", "awq", "gptq")
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors", "fbgemm_fp8": "fp8"}


class UnsupportedQuantization(ValueError):
    def __init__(self, what: str):
        super().__init__(f"unsupported quantization: {what}. Supported: " + "; ".join(SUPPORTED))


@dataclass(frozen=True)
class Scheme:
    """One layer's quantization. `group_size` None: one scale per output channel (or, with
    `tensor_scale`, one per checkpoint tensor); `block_rows`: FP8 block scales' rows per block."""

    fp8: bool  # float8_e4m3fn weights; otherwise integer codes of `bits` bits
    bits: int
    group_size: int | None = None
    symmetric: bool = True
    block_rows: int | None = None
    tensor_scale: bool = False
    act_dynamic: bool = False  # dynamic FP8 activations, per token ...
    act_group: int | None = None  # ... or per group of this many inputs


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of METHODS
    fmt: str  # compressed-tensors' format (pack-quantized, naive-quantized, float-quantized), "gptq"/"gptq_v2",
    # "gemm" (AWQ), "checkpoint" (fp8) or "online" (dense weights quantized at load)
    groups: tuple = ()  # ((targets, Scheme), ...), the first matching group wins
    ignore: tuple = ()
    default: Scheme | None = None  # every linear layer but the ignored ones (AWQ, GPTQ, fp8)
    extra: dict = field(default_factory=dict)

    def scheme_for(self, name: str) -> Scheme | None:
        """The scheme of the checkpoint's linear layer `name` (e.g. model.layers.0.self_attn.q_proj)."""
        if name == "lm_head" or any(_matches(pattern, name) for pattern in self.ignore):
            return None
        if self.default is not None:
            return self.default
        for targets, scheme in self.groups:
            if any(_matches(target, name) for target in targets):
                return scheme
        return None


def _matches(pattern: str, name: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def detect(raw_config: dict, requested: str | None) -> QuantConfig | None:
    """The checkpoint's quantization (config.json as a dict), checked against `LLM(quantization=...)`."""
    requested = ALIASES.get(requested, requested) if requested else None
    qc = raw_config.get("quantization_config") or {}
    if qc.get("quant_method") == "mxfp4" and requested in (None, "mxfp4"):
        return None  # gpt-oss's MXFP4 experts: dequantised at load (engine.models.gpt_oss); the rest is dense
    if requested is not None and requested not in METHODS:
        raise UnsupportedQuantization(f"quantization={requested!r}")
    qc = raw_config.get("quantization_config") or raw_config.get("compression_config")
    if qc is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with it; this one has no "
                "quantization_config (only 'fp8' quantizes an unquantized checkpoint at load)"
            )
        return QuantConfig("fp8", "online", default=Scheme(fp8=True, bits=8))
    method = ALIASES.get(qc.get("quant_method"), qc.get("quant_method"))
    if method not in METHODS:
        raise UnsupportedQuantization(f"quant_method {qc.get('quant_method')!r}")
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's quant_method {method!r}")
    return {"compressed-tensors": _compressed_tensors, "fp8": _fine_grained_fp8, "awq": _awq, "gptq": _gptq}[method](qc)


def _compressed_tensors(qc: dict) -> QuantConfig:
    if qc.get("kv_cache_scheme"):
        raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (quantized KV cache)")
    if (qc.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        raise UnsupportedQuantization("compressed-tensors sparsity")
    if (qc.get("transform_config") or {}).get("config_groups"):
        raise UnsupportedQuantization("compressed-tensors transforms")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        groups.append((tuple(group.get("targets") or ()), _ct_scheme(name, group, fmt)))
        if fmt not in ("pack-quantized", "naive-quantized", "float-quantized", "int-quantized"):
            raise UnsupportedQuantization(f"compressed-tensors format {fmt!r}")
    if not groups:
        raise UnsupportedQuantization("compressed-tensors config without config_groups")
    fmts = {(g.get("format") or qc.get("format")) for g in qc["config_groups"].values()}
    return QuantConfig(
        "compressed-tensors",
        fmts.pop() if len(fmts) == 1 else "mixed",
        groups=tuple(groups),
        ignore=tuple(qc.get("ignore") or ()),
    )


def _ct_scheme(name: str, group: dict, fmt: str) -> Scheme:
    w, act = group.get("weights"), group.get("input_activations")
    if w is None or group.get("output_activations"):
        raise UnsupportedQuantization(f"compressed-tensors group {name!r} without weights or with output activations")
    strategy, bits, kind = w.get("strategy"), w.get("num_bits"), w.get("type")
    if w.get("dynamic") or w.get("actorder") not in (None, "group", "static", "weight"):
        raise UnsupportedQuantization(f"compressed-tensors weights {w}")
    act_dynamic, act_group = False, None
    if act is not None:
        ok = (
            act.get("type") == "float"
            and act.get("num_bits") == 8
            and act.get("dynamic") is True
            and act.get("symmetric", True)
            and act.get("strategy") in ("token", "group")
        )
        if not ok:
            raise UnsupportedQuantization(f"compressed-tensors input activations {act} (group {name!r})")
        act_dynamic, act_group = True, act.get("group_size") if act.get("strategy") == "group" else None
    if kind == "float" and bits == 8 and w.get("symmetric", True):
        if strategy == "block":
            rows, cols = w["block_structure"]
            return Scheme(True, 8, group_size=cols, block_rows=rows, act_dynamic=act_dynamic, act_group=act_group)
        if strategy in ("channel", "tensor"):
            return Scheme(True, 8, tensor_scale=strategy == "tensor", act_dynamic=act_dynamic, act_group=act_group)
    packed = fmt == "pack-quantized" or (fmt in ("naive-quantized", "int-quantized") and bits == 8)
    if kind == "int" and bits in (4, 8) and act is None and strategy in ("group", "channel") and packed:
        return Scheme(
            False,
            bits,
            group_size=w.get("group_size") if strategy == "group" else None,
            symmetric=bool(w.get("symmetric", True)),
        )
    raise UnsupportedQuantization(f"compressed-tensors group {name!r}: weights {w}, activations {act}, format {fmt}")


def _fine_grained_fp8(qc: dict) -> QuantConfig:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedQuantization(f"fp8 activation_scheme {qc.get('activation_scheme')!r}")
    block = qc.get("weight_block_size")
    scheme = (
        Scheme(True, 8, group_size=block[1], block_rows=block[0], act_dynamic=True, act_group=block[1])
        if block
        else Scheme(True, 8, tensor_scale=True, act_dynamic=True)
    )
    return QuantConfig("fp8", "checkpoint", default=scheme, ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _awq(qc: dict) -> QuantConfig:
    bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise UnsupportedQuantization(f"awq bits={bits} version={version} zero_point={qc.get('zero_point')}")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return QuantConfig(
        "awq",
        "gemm",
        default=Scheme(False, 4, group_size=None if group == -1 else group, symmetric=False),
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _gptq(qc: dict) -> QuantConfig:
    bits, fmt = qc.get("bits"), qc.get("checkpoint_format", "gptq")
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2") or qc.get("dynamic"):
        raise UnsupportedQuantization(f"gptq bits={bits} checkpoint_format={fmt} dynamic={qc.get('dynamic')}")
    group = qc.get("group_size", 128)
    # symmetric or not, GPTQ checkpoints hold zero points (8, stored as 7 in the v1 format, when symmetric)
    scheme = Scheme(False, bits, group_size=None if group == -1 else group, symmetric=False)
    return QuantConfig("gptq", fmt, default=scheme, ignore=tuple(qc.get("modules_to_not_convert") or ()))
