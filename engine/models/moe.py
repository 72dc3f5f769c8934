"""The mixture-of-experts block: a softmax router choosing k experts per token, the experts'
SwiGLU MLPs run grouped by expert, and an optional shared expert behind a sigmoid gate.

Mixtral renormalises the chosen k probabilities (`norm_topk_prob` is always on for it); Qwen2-MoE
and Qwen3-MoE do so where their config says. The experts' weights live as two 3-D tensors, as
transformers 5 holds them: `gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows first) and
`down_proj` [experts, hidden, intermediate].

With the Triton kernel set the experts run in the fused kernel (`pagedbatch_kernels.fused_moe`: two
grouped GEMM launches, no host read). Otherwise `grouped_experts` sorts the (token, choice) pairs by
expert and runs one pair of matmuls per expert that has tokens: a Python loop over experts, never
over tokens; on the CPU, small steps that fill most experts take `dense_experts` (every expert on
every token, five calls). CUDA graphs stay off for MoE models for now (the fused path is graph-safe
by construction but has not been run on a GPU here).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import MLP
from engine.ops import Ops

SERIAL_ROWS = 64  # on the CPU, experts' matmuls averaging fewer rows than this run on one thread
DENSE_TOKENS = 64  # see use_dense
MAX_DENSE_FACTOR = 8


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
    with _one_thread_if(x.device.type == "cpu" and len(flat) < SERIAL_ROWS * len(counts)):
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                out[start:end] = F.linear(silu_and_mul(F.linear(rows[start:end], gate_up[expert])), down[expert])
                start = end
    scaled = out.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    total = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    total.index_add_(0, token_of, scaled)
    return total.to(x.dtype)


def dense_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """`grouped_experts` by running every expert on every token and weighting the unchosen by zero:
    E/k times the arithmetic, in five calls whatever the number of experts. For the CPU's small
    steps (decodes), where each call costs more than its arithmetic and most experts are chosen
    by some token anyway (so every expert's weights are read either way)."""
    tokens, hidden = x.shape
    experts, double, _ = gate_up.shape
    h = silu_and_mul(F.linear(x, gate_up.reshape(experts * double, hidden)).reshape(tokens * experts, double))
    out = torch.bmm(h.reshape(tokens, experts, double // 2).transpose(0, 1), down.transpose(1, 2))  # [E, T, H]
    dense = torch.zeros(tokens, experts, dtype=torch.float32, device=x.device).scatter_(1, ids, weights.float())
    return torch.einsum("te,eth->th", dense, out.float()).to(x.dtype)


def use_dense(x: torch.Tensor, num_experts: int, top_k: int) -> bool:
    """The dense path on the CPU for up to DENSE_TOKENS tokens choosing at least half the experts' worth
    of slots (and never where it multiplies the arithmetic more than MAX_DENSE_FACTOR times)."""
    tokens = x.shape[0]
    return (x.device.type == "cpu" and os.environ.get("PAGEDBATCH_MOE_PATH") != "grouped"
            and 0 < tokens <= DENSE_TOKENS and 2 * tokens * top_k >= num_experts
            and num_experts <= MAX_DENSE_FACTOR * top_k)


@contextlib.contextmanager
def _one_thread_if(serial: bool):
    """One intra-op thread for the experts' small matmuls: each is too small to share, and a
    parallel region per matmul waits on every thread of the team (on a busy host, for one that is
    descheduled)."""
    before = torch.get_num_threads()
    if not serial or before == 1 or os.environ.get("PAGEDBATCH_MOE_THREADS") == "all":
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops):
        super().__init__()
        self.ops = ops
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ops.fused_moe is not None:
            return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)
        if use_dense(x, self.gate_up_proj.shape[0], ids.shape[1]):
            return dense_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.ops.silu_and_mul)
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
        with _one_thread_if(x.device.type == "cpu" and x.shape[0] <= DENSE_TOKENS):  # a decode step's few rows
            weights, ids = route(self.gate(x), self.top_k, self.normalize)
            out = self.experts(x, weights, ids)
            if self.shared_expert is not None:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
