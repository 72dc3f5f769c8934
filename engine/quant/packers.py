"""Our own AWQ, GPTQ and fine-grained FP8 checkpoint writers (for tests and benchmarks): each linear
layer of a dense checkpoint quantized round-to-nearest (4-bit asymmetric per group; FP8 per block),
packed in the format's layout, with the dense dequantized twin written beside it so that the engine
on the quantized checkpoint can be compared with the engine (or transformers) on exact weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.quant.formats import AWQ_ORDER, FP8_MAX

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group: int, bits: int = 4):
    """Round-to-nearest asymmetric codes [N, K], scales and zero codes [N, K/group] of `w` [N, K]."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    top = (1 << bits) - 1
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / top).clamp(min=1e-4).half().float()  # the checkpoints store float16 scales
    zeros = (-lo / scales).round().clamp(0, top)
    codes = (g / scales[..., None] + zeros[..., None]).round().clamp(0, top)
    return codes.reshape(n, k).int(), scales, zeros.int()


def _words(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """[R, C] codes -> [R, C*bits/32] int32, code j of each word at bits*j (little end first)."""
    per = 32 // bits
    c = codes.reshape(codes.shape[0], -1, per).long()
    shifts = torch.arange(per) * bits
    words = (c << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _awq_words(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> AWQ words: nibble i of each word holds column AWQ_ORDER[i] of its eight."""
    grouped = codes.reshape(codes.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return _words(grouped.reshape(codes.shape[0], -1))


def pack_awq(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    codes, scales, zeros = quantize_groups(w, group)
    deq = ((codes.reshape(scales.shape[0], -1, group) - zeros[..., None]) * scales[..., None]).reshape(w.shape)
    return {
        "qweight": _awq_words(codes.t().contiguous()),
        "qzeros": _awq_words(zeros.t().contiguous()),
        "scales": scales.t().contiguous().half(),
    }, deq


def pack_gptq(
    w: torch.Tensor, group: int, act_order: bool = False, v1: bool = True, seed: int = 0
) -> tuple[dict, torch.Tensor]:
    """GPTQ layout; with `act_order` the inputs' groups are a random permutation (g_idx)."""
    n, k = w.shape
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    codes, scales, zeros = quantize_groups(w[:, perm], group)  # groups over permuted inputs
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).int()
    unperm = torch.empty_like(codes)
    unperm[:, perm] = codes
    deq = (unperm - zeros[:, g_idx.long()]) * scales[:, g_idx.long()]
    stored = (zeros - 1) & 15 if v1 else zeros
    return {
        "qweight": _words(unperm).t().contiguous(),  # packed along the inputs: [K/8, N]
        "qzeros": _words(stored.t().contiguous()),
        "scales": scales.t().contiguous().half(),
        "g_idx": g_idx,
    }, deq


def pack_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    br, bc = block
    wf = w.float()
    padded = torch.nn.functional.pad(wf, (0, -k % bc, 0, -n % br))
    tiles = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:n, :k]
    q = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def write_packed(src: Path, out: Path, dense_out: Path, method: str, group: int = 32, **kw) -> tuple[Path, Path]:
    """Quantize `src`'s linear layers into `out` (method awq, gptq or fp8) and their dequantized weights
    into `dense_out` (an ordinary checkpoint); tokenizer and generation config are copied to both."""
    src, out, dense_out = Path(src), Path(out), Path(dense_out)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dense = {}, {}
    for name, w in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or module.rpartition(".")[2] not in LINEARS:
            quantized[name] = dense[name] = w
            continue
        if method == "awq":
            parts, deq = pack_awq(w, group)
        elif method == "gptq":
            parts, deq = pack_gptq(w, group, **kw)
        else:
            parts, deq = pack_fp8_blocks(w, (group, group))
        quantized.update({f"{module}.{p}": t for p, t in parts.items()})
        dense[name] = deq.to(w.dtype)
    config = json.loads((src / "config.json").read_text())
    quant = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
        "gptq": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "sym": False,
            "desc_act": bool(kw.get("act_order")),
            "checkpoint_format": "gptq" if kw.get("v1", True) else "gptq_v2",
        },
        "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [group, group]},
    }
    for path, weights, cfg in (
        (out, quantized, {**config, "quantization_config": quant[method]}),
        (dense_out, dense, config),
    ):
        path.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json") and f.is_file():
                shutil.copy(f, path / f.name)
    return out, dense_out
