"""The mixture-of-experts block: a softmax router choosing k experts per token, the experts'
SwiGLU MLPs run grouped by expert, and an optional shared expert behind a sigmoid gate.

Mixtral renormalises the chosen k probabilities (`norm_topk_prob` is always on for it); Qwen2-MoE
and Qwen3-MoE do so where their config says. The experts' weights live as two 3-D tensors, as
transformers 5 holds them: `gate_up_proj` [experts, 2 * intermediate, hidden] (gate rows first) and
`down_proj` [experts, hidden, intermediate].

With the Triton kernel set the experts run in the fused kernel (`pagedbatch_kernels.fused_moe`: two
grouped GEMM launches, no host read). Otherwise `grouped_experts` sorts the (token, choice) pairs by
expert and runs one pair of matmuls per expert that has tokens: a Python loop over experts, never
over tokens; on the CPU, `padded_experts` runs every expert's rows at once in two batched matmuls
over a zero-padded [experts, C, hidden] batch (where the padding stays small); where the native
kernels are built, the SwiGLU experts without biases run in `pagedbatch_kernels.cpu.cpu_moe` instead
(each chosen expert's weights read once for all its rows, the others not at all; faster than both at
every step size measured, 1..4096 tokens), except bfloat16 prompt steps on a CPU with AMX, which its GEMMs
multiply faster (`cpu_moe.prefers_gemm`). CUDA graphs stay off
for MoE models for now (the fused path is graph-safe by construction but has not been run on a GPU
here).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.hf.config import ModelConfig
from engine.models.llama import MLP
from engine.runner.cpu_threads import one_thread
from engine.runner.ops import Ops
from pagedbatch_kernels.cpu import cpu_moe
from settings import EngineSettings, value

SERIAL_ROWS = 64  # on the CPU, experts' matmuls averaging fewer rows than this run on one thread
DENSE_TOKENS = 64  # on the CPU, blocks of at most this many tokens (decode steps) route on one thread
PAD_FACTOR = 4  # padded_experts: at most this many times the rows the (token, choice) slots need


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) from router logits [T, experts]: softmax over all
    experts in float32, the k largest, renormalised to sum to one with `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    silu_and_mul,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, [T, hidden]; `silu_and_mul`
    is the activation of the gate/up rows, `biases` (gpt-oss) the experts' gate/up and down biases.

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
                b1, b2 = (None, None) if biases is None else (biases[0][expert], biases[1][expert])
                out[start:end] = F.linear(
                    silu_and_mul(F.linear(rows[start:end], gate_up[expert], b1)), down[expert], b2
                )
                start = end
    scaled = out.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    total = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device)
    total.index_add_(0, token_of, scaled)
    return total.to(x.dtype)


def padded_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    silu_and_mul,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`grouped_experts` as two batched matmuls over every expert at once: each expert's rows go into
    a zero-padded [experts, C, hidden] batch (C: the busiest expert's row count), so the arithmetic is
    experts * C rows instead of T * k, in a dozen calls whatever the number of experts. Where padding
    would pass PAD_FACTOR times the rows (few slots among many experts, whose weights would all be
    read for nothing), `grouped_experts`. Never more arithmetic than every expert on every token
    (C <= T), and one parallel region per call instead of one per expert's small matmul.

    Each (token, choice) slot's place is found without sorting: its rank among the earlier slots of
    the same expert (a cumulative count), so the outputs come back in token order for the weighting."""
    tokens, hidden = x.shape
    experts, k = gate_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    onehot = F.one_hot(flat, experts)  # [T * k, E]
    counts = onehot.sum(0)
    capacity = int(counts.max()) if flat.numel() else 0
    if capacity == 0 or experts * capacity > PAD_FACTOR * flat.numel():
        return grouped_experts(x, gate_up, down, weights, ids, silu_and_mul, biases)
    rank = onehot.cumsum(0).gather(1, flat.unsqueeze(1)).squeeze(1) - 1
    place = flat * capacity + rank
    batch = x.new_zeros(experts * capacity, hidden)
    batch.index_copy_(0, place, x.repeat_interleave(k, dim=0))
    h = torch.bmm(batch.view(experts, capacity, hidden), gate_up.transpose(1, 2))
    if biases is not None:
        h = h + biases[0].unsqueeze(1)
    h = silu_and_mul(h)
    out = torch.bmm(h, down.transpose(1, 2))
    if biases is not None:
        out = out + biases[1].unsqueeze(1)
    rows = out.view(experts * capacity, hidden).index_select(0, place).view(tokens, k, hidden)
    return torch.einsum("tk,tkh->th", weights.float(), rows.float()).to(x.dtype)


def _one_thread_if(serial: bool):
    """One intra-op thread for the experts' small matmuls: each is too small to share, and a
    parallel region per matmul waits on every thread of the team (on a busy host, for one that is
    descheduled)."""
    return one_thread(serial and value(EngineSettings, "moe_threads") != "all")


class Experts(nn.Module):
    """The routed experts; gpt-oss's have biases and an activation of their own (`act`, of the
    gate/up rows), which the fused kernel does not take: they run grouped."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: Ops, bias: bool = False, act=None):
        super().__init__()
        self.ops = ops
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.biases = bias
        self.act = act
        self.packed = False

    def _pack(self, packed: bool) -> None:
        """The weights as the native kernel reads them (`cpu_moe.pack_experts`, in place of the plain
        tensors: the memory stays 1x), packed at its first call after loading; back to the plain layout
        (once) for a torch path (PAGEDBATCH_MOE_PATH=grouped set later, tests)."""
        if packed == self.packed:
            return
        hidden = self.gate_up_proj.shape[3] if self.packed else self.down_proj.shape[1]
        change = cpu_moe.pack_experts if packed else lambda g, d: cpu_moe.unpack_experts(g, d, hidden)
        with torch.no_grad():
            self.gate_up_proj.data, self.down_proj.data = change(self.gate_up_proj.data, self.down_proj.data)
        self.packed = packed

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, few: bool = False) -> torch.Tensor:
        """The weighted experts' sum; `few`: a CPU step of few rows, whose torch paths run on one thread (the
        native kernel decides for itself: one parallel region per call, its work split by expert and outputs)."""
        plain = self.act is None and not self.biases
        padded = x.device.type == "cpu" and value(EngineSettings, "moe_path") != "grouped"
        native = padded and plain and self.ops.fused_moe is None and cpu_moe.takes(x, self.gate_up_proj, self.down_proj)
        self._pack(native)
        if native:
            run = cpu_moe.moe_gemm if cpu_moe.prefers_gemm(x) else cpu_moe.moe_packed
            return run(x, self.gate_up_proj, self.down_proj, weights, ids)
        if self.ops.fused_moe is not None and plain:
            return self.ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids)
        act = self.act or self.ops.silu_and_mul
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.biases else None
        with _one_thread_if(few):
            return (padded_experts if padded else grouped_experts)(
                x, self.gate_up_proj, self.down_proj, weights, ids, act, biases
            )


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
        few = x.device.type == "cpu" and x.shape[0] <= DENSE_TOKENS  # a decode step's few rows
        with _one_thread_if(few):
            weights, ids = route(self.gate(x), self.top_k, self.normalize)
        out = self.experts(x, weights, ids, few)
        if self.shared_expert is not None:
            with _one_thread_if(few):
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
