"""The mixture-of-experts block: a softmax router choosing k experts per token, the experts'
SwiGLU MLPs run grouped by expert, and an optional shared expert behind a sigmoid gate.

Mixtral renormalises the chosen k probabilities (`norm_topk_prob` is always on for it); Qwen2-MoE
and Qwen3-MoE do so where their config says. The experts' weights live as two 3-D tensors, as
transformers 5 holds them: `gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows first) and
`down_proj` [experts, hidden, intermediate].

`grouped_experts` sorts the (token, choice) pairs by expert and runs one pair of matmuls per expert
that has tokens: a Python loop over experts, never over tokens. It reads the per-expert counts on
the host, so a step through it cannot be captured in a CUDA graph (the runner keeps MoE models
eager there).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import MLP
from engine.ops import Ops


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, experts]: softmax over all
    experts in float32, the k largest, renormalised to sum to one with `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, [T, hidden].

    The T*k (token, choice) rows are sorted by expert (stable, so a token's rows keep their order),
    each expert's contiguous run goes through its gate/up and down projections in one matmul each,
    and the weighted rows are summed back per token in float32."""
    tokens, hidden = x.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // ids.shape[1]
    rows = x.index_select(0, token_of)
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            out[start:end] = F.linear(silu_and_mul(F.linear(rows[start:end], gate_up[expert])), down[expert])
            start = end
    scaled = out.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    total = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    total.index_add_(0, token_of, scaled)
    return total.to(x.dtype)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops):
        super().__init__()
        self.ops = ops
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.ops.silu_and_mul)


class SparseMoeBlock(nn.Module):
    """Router `gate`, routed `experts`, and (Qwen2-MoE) `shared_expert` scaled by
    sigmoid(`shared_expert_gate`), as the checkpoints name them."""

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.normalize = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, ops)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(replace(cfg, intermediate_size=moe.shared_expert_intermediate_size), ops)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
