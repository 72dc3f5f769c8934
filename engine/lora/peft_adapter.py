"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) into
per-layer, per-module (A, B) pairs with the adapter's scaling folded into B, as PEFT computes:
`base(x) + lora_B(lora_A(x)) * scaling`, scaling = alpha / r, or alpha / sqrt(r) under rsLoRA
(`use_rslora`); `rank_pattern` / `alpha_pattern` give single modules ranks and alphas of their own.
What this engine cannot apply (DoRA, bias training, `modules_to_save`, embedding or LM-head adapters)
is refused with the reason, never silently dropped."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The checkpoint module names an adapter may target, and the attention/MLP block each lives in.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "qkv_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "gate_up_proj": "mlp",
}
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    rank: int  # the largest rank of its modules
    # (layer, checkpoint module name) -> (A [r, in], B [out, r] times the scaling), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory: it has no adapter_config.json")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not a LoRA adapter")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that train whole modules (modules_to_save) are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    }
    for key, why in refused.items():
        if config.get(key):
            raise ValueError(f"{path}: {why}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: adapters that train biases (bias={config['bias']!r}) are not supported")
    return config


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def load_peft_adapter(path: str | Path, name: str, int_id: int, max_rank: int) -> LoRAAdapter:
    """The adapter at `path`; ValueError naming the problem if it cannot be served."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory")
    config = read_adapter_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{path}: no adapter_model.safetensors (only safetensors adapters load)")
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_names: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in TARGETS or TARGETS[m.group(3)] != m.group(2):
            raise ValueError(
                f"{path}: tensor {key!r} is not on a supported module "
                f"(LoRA applies to {', '.join(sorted(TARGETS))} of the decoder layers)"
            )
        layer, module = int(m.group(1)), m.group(3)
        pairs.setdefault((layer, module), {})[m.group(4)] = tensor
        module_names[(layer, module)] = key.split(".lora_")[0]
    adapter = LoRAAdapter(name, int_id, 0)
    for where, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: layer {where[0]} {where[1]} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if b.shape[1] != r:
            raise ValueError(f"{path}: layer {where[0]} {where[1]}: lora_A has rank {r}, lora_B {b.shape[1]}")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {r}, above max_lora_rank={max_rank}")
        full_name = module_names[where]
        alpha = _pattern_value(config.get("alpha_pattern"), full_name, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        adapter.weights[where] = (a.contiguous(), (b * scaling).contiguous())
        adapter.rank = max(adapter.rank, r)
    if not adapter.weights:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return adapter
