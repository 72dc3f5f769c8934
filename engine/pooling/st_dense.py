"""sentence-transformers' `Dense` modules (a linear layer and an activation after pooling, before
`Normalize`), loaded from their directories (`config.json` and `model.safetensors`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

_ACTIVATIONS = {"Identity": nn.Identity, "Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid, "ReLU": nn.ReLU, "GELU": nn.GELU}


def _dense(folder: Path) -> nn.Module:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the Dense module's config in {folder}: {exc}") from exc
    act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if act not in _ACTIVATIONS:
        raise ValueError(f"Dense activation {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"the Dense module in {folder} has no model.safetensors")
    linear = nn.Linear(cfg["in_features"], cfg["out_features"], bias=cfg.get("bias", True))
    state = {k.removeprefix("linear."): v for k, v in load_file(str(weights)).items()}
    linear.load_state_dict(state)
    return nn.Sequential(linear, _ACTIVATIONS[act]())


def load_dense_head(folders: list[Path]) -> nn.Module | None:
    """The Dense layers in order (float32, CPU: they run on pooled vectors), or None for none."""
    if not folders:
        return None
    head = nn.Sequential(*(_dense(Path(f)) for f in folders)).float().eval()
    for p in head.parameters():
        p.requires_grad_(False)
    return head


def apply(head: nn.Module | None, pooled: torch.Tensor) -> torch.Tensor:
    if head is None:
        return pooled
    with torch.no_grad():
        return head(pooled.float().cpu()[None])[0]
