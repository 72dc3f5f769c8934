"""DeepSeek V2 and V3: the Llama-family decoder with latent attention (`engine.models.mla`) in every
layer, dense MLPs in the first `first_k_dense_replace` layers and, after them, experts (grouped by
expert, `engine.models.moe.Experts`) behind DeepSeek's routers plus always-on shared experts.

Routers (`grouped_route`), as transformers computes them, in float32 (the router's weights stay
float32 in a bfloat16 model, as transformers keeps them):
- V2: softmax over the experts; with `group_limited_greedy`, only the `topk_group` groups whose best
  expert scores highest compete; the k best, times `routed_scaling_factor`.
- V3: sigmoid scores; the choice ranks score + `e_score_correction_bias`, within the `topk_group`
  groups whose two best biased scores sum highest; the chosen experts' unbiased scores, renormalised
  (`norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf.config import ModelConfig
from engine.hf.moe_config import MoEConfig
from engine.models.llama import MLP
from engine.models.mla import LatentAttention
from engine.models.moe import Experts
from engine.models.moe_causal_lm import MoEForCausalLM
from engine.runner.ops import Ops

_LAYER = re.compile(r"^(?:model\.)?layers\.(?P<index>\d+)\.")


def grouped_route(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from float32 router logits [T, experts]."""
    routing = moe.routing
    sigmoid = routing.scoring == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if routing.n_group:
        groups = choice.view(choice.shape[0], routing.n_group, -1)
        ranks = groups.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else groups.max(dim=-1).values
        chosen = torch.topk(ranks, k=routing.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(ranks, dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.unsqueeze(-1).expand_as(groups).reshape_as(choice)
        choice = choice.masked_fill(~keep, float("-inf") if sigmoid else 0.0)
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    keeps_float32 = True  # the runner casts the model to its dtype, then these back to float32

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size))
        if cfg.moe.routing.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.moe.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return grouped_route(logits, self.moe, self.e_score_correction_bias)


class DeepseekMoE(nn.Module):
    """Router `gate`, routed `experts` and `shared_experts` (one MLP of n_shared_experts' width), as
    the checkpoints name them."""

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        moe = cfg.moe
        self.gate = Router(cfg)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, ops)
        self.shared_experts = MLP(replace(cfg, intermediate_size=moe.shared_expert_intermediate_size), ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids) + self.shared_experts(x)


class DeepseekForCausalLM(MoEForCausalLM):
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # no fused QKV here

    def make_mlp(self, cfg: ModelConfig, layer: int, ops: Ops) -> nn.Module | None:
        return DeepseekMoE(cfg, ops) if cfg.moe.is_sparse(layer) else None

    def make_attention(self, cfg: ModelConfig, layer: int, ops: Ops) -> nn.Module:
        return LatentAttention(cfg, layer, ops)

    def skips_checkpoint_weight(self, name: str) -> bool:
        """The layers past num_hidden_layers: V3's multi-token-prediction module, which transformers
        does not load either."""
        m = _LAYER.match(name)
        return m is not None and int(m["index"]) >= self.cfg.num_layers
