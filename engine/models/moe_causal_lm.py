"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (attention, norms, embeddings as in
`engine.models.llama`) with the expert block (`engine.models.moe`) as the MLP of the sparse layers.

Checkpoint layouts placed here, beside the dense ones the loader packs itself:
- per expert, `experts.E.{gate_proj,up_proj,down_proj}.weight` (Qwen) or `experts.E.{w1,w3,w2}.weight`
  under `block_sparse_moe.` (Mixtral), as the hub checkpoints and transformers' `save_pretrained` write;
- fused, `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I], transformers 5's
  in-memory layout (a state dict saved as is);
- the shared expert's gate/up, packed at its own intermediate size.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.hf.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import SparseMoeBlock
from engine.runner.ops import Ops

# per-expert weight name -> (our fused parameter, shard: 0 gate, 1 up, None the whole expert's down)
_PER_EXPERT = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
_EXPERT = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)(?:\.weight)?$")
# Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts`: their gate/up packed into one gate_up_proj
_SHARED = re.compile(r"^(?P<mlp>.+\.mlp\.shared_experts?)\.(?P<part>gate_proj|up_proj)\.weight$")


class MoEForCausalLM(LlamaForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer: int, ops: Ops) -> nn.Module | None:
        return SparseMoeBlock(cfg, ops) if cfg.moe.is_sparse(layer) else None

    def checkpoint_slot(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, list[str]] | None:
        """Where checkpoint weight `name` goes: (the view of our parameter (in `params`, ours by
        name) it fills, the keys it covers for the completeness check); None for the names the
        loader places itself."""
        original, name = name, name.replace(".block_sparse_moe.", ".mlp.")
        if m := _EXPERT.match(name):
            param_name, shard = _PER_EXPERT.get(m["part"], (None, None))
            target = f"{m['block']}.{param_name}"
            if param_name is None or target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in the model")
            expert = int(m["expert"])
            if expert >= params[target].shape[0]:
                raise ValueError(f"checkpoint weight {name!r}: expert {expert} of {params[target].shape[0]}")
            view = params[target][expert]
            if shard is not None:
                size = view.shape[0] // 2
                view = view.narrow(0, shard * size, size)
            return view, [f"{target}#{expert}#{shard}"]
        if m := _FUSED.match(name):
            target = f"{m['block']}.{m['param']}"
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in the model")
            return params[target], self.expected_keys(target)
        if m := _SHARED.match(name):
            target = f"{m['mlp']}.gate_up_proj.weight"
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in the model")
            size = params[target].shape[0] // 2
            shard = 0 if m["part"] == "gate_proj" else 1
            return params[target].narrow(0, shard * size, size), [f"{target}#{shard}"]
        if name != original:  # Mixtral's router
            if name not in params:
                raise ValueError(f"checkpoint weight {original!r} has no place in the model")
            return params[name], [name]
        return None

    def expected_keys(self, param_name: str) -> list[str] | None:
        """The keys `checkpoint_slot` must have covered for our parameter to be complete; None
        for the parameters the loader checks itself."""
        if param_name.endswith(".experts.gate_up_proj"):
            return [f"{param_name}#{e}#{s}" for e in range(self.cfg.moe.num_experts) for s in (0, 1)]
        if param_name.endswith(".experts.down_proj"):
            return [f"{param_name}#{e}#None" for e in range(self.cfg.moe.num_experts)]
        if param_name.endswith(".shared_expert.gate_up_proj.weight"):
            return [f"{param_name}#{s}" for s in (0, 1)]
        return None
