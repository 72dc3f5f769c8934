"""Rotary position tables: default, Llama 3, linear, YaRN and LongRoPE (Phi-3) frequencies, with the
attention factor (YaRN, LongRoPE) folded into cos and sin as transformers does."""

from __future__ import annotations

import math

import torch


def _base_frequencies(dim: int, theta: float, dtype=torch.float64) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_factor(scaling: dict) -> float:
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return factor


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = _yarn_factor(scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    old_len = scaling["original_max_position_embeddings"]

    def correction(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, scaling: dict, long: bool) -> tuple[torch.Tensor, float]:
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta**shape), float(attention)


def _frequencies(dim: int, theta: float, scaling: dict | None, long: bool = False) -> tuple[torch.Tensor, float]:
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    if kind == "longrope":
        return _longrope(dim, theta, scaling, long)
    inv_freq = _base_frequencies(dim, theta)
    if kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq.float() / scaling["factor"]
    return inv_freq.float(), 1.0


def _table(inv_freq: torch.Tensor, positions: torch.Tensor, attention: float) -> torch.Tensor:
    angles = torch.outer(positions.float(), inv_freq)
    return torch.cat((angles.cos() * attention, angles.sin() * attention), dim=-1)


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[max_positions, head_dim] = cat(cos, sin), each over head_dim / 2 frequencies (head_dim: the
    rotary size). LongRoPE: positions past `original_max_position_embeddings` take the long factors,
    the others the short ones (transformers switches a whole forward pass to the long factors once the
    sequence is longer; the same wherever no sequence crosses that length)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq, attention = _frequencies(head_dim, theta, scaling)
    table = _table(inv_freq, positions, attention)
    if (scaling or {}).get("rope_type") == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        if max_positions > old_len:
            long_freq, attention = _frequencies(head_dim, theta, scaling, long=True)
            table[old_len:] = _table(long_freq, positions[old_len:], attention)
    return table
