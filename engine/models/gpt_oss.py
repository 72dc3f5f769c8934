"""gpt-oss: the Llama-family decoder with attention sinks and biases (engine.models.llama, switched on
by its config), alternating sliding and full layers, YaRN RoPE, and this expert block: a router with
a bias whose softmax runs over the k chosen logits only, and experts with biases and a clamped SwiGLU.

The experts are held in our layout (`engine.models.moe.Experts`: gate_up_proj [E, 2I, H] gate rows
first, down_proj [E, H, I]). The checkpoints' own layouts are converted at load:
- transformers' (the `-BF16` hub checkpoints, `save_pretrained`): gate_up_proj [E, H, 2I] with gate and
  up interleaved column by column, down_proj [E, I, H], gate_up_proj_bias [E, 2I] interleaved;
- the hub's MXFP4 (`*_blocks` [E, out, H / 32, 16] + `*_scales` [E, out, H / 32], rows interleaved as
  above): dequantised to the model's dtype (engine.quant.mxfp4), blocks and scales in either order.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from engine.hf.config import ModelConfig
from engine.models.moe import DENSE_TOKENS, Experts, _one_thread_if
from engine.models.moe_causal_lm import MoEForCausalLM
from engine.quant.mxfp4 import dequantize_mxfp4
from engine.runner.ops import Ops

_EXPERTS = re.compile(
    r"^(?P<block>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)(?P<kind>_bias|_blocks|_scales|)$"
)


def route_after_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the k largest logits, soft-maxed among themselves."""
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of gate/up rows [..., 2I] (gate first): the gate clamped above at `limit`,
    up to +-limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up interleaved along `dim` (g0, u0, g1, u1, ...) -> all gates, then all ups."""
    size = t.shape[dim]
    index = torch.cat((torch.arange(0, size, 2), torch.arange(1, size, 2))).to(t.device)
    return t.index_select(dim, index)


class GptOssMoeBlock(nn.Module):
    """`router` (with its bias) and the biased `experts`, as the checkpoints name them."""

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        moe = cfg.moe
        self.top_k = moe.top_k
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=True)
        act = partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, ops, bias=True, act=act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _one_thread_if(x.device.type == "cpu" and x.shape[0] <= DENSE_TOKENS):
            weights, ids = route_after_topk(self.router(x), self.top_k)
            return self.experts(x, weights, ids)


class GptOssForCausalLM(MoEForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer: int, ops: Ops) -> nn.Module:
        return GptOssMoeBlock(cfg, ops)

    def take_checkpoint_tensor(self, name: str, read) -> list[str] | None:
        """Place expert tensor `name` (`read()` gives it) in our layout; returns the parameters it
        completed ([] while an MXFP4 pair waits for its other half), None for names not ours to place."""
        m = _EXPERTS.match(name)
        if m is None:
            return None
        target = f"{m['block']}.{m['param']}"
        params = dict(self.named_parameters())
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in the model")
        gate_up = m["param"] == "gate_up_proj"
        if m["kind"] == "_bias":
            bias = read()
            self._fill(params[f"{target}_bias"], deinterleave(bias, 1) if gate_up else bias, name)
            return [f"{target}_bias"]
        if m["kind"] == "":  # transformers' [E, in, out]
            self._fill(params[target], self._ours(read().transpose(1, 2), gate_up), name)
            return [target]
        pending = self.__dict__.setdefault("_mxfp4_halves", {})
        halves = pending.setdefault(target, {})
        halves[m["kind"]] = read()
        if len(halves) < 2:
            return []
        del pending[target]
        weight = dequantize_mxfp4(halves["_blocks"], halves["_scales"], params[target].dtype)
        self._fill(params[target], self._ours(weight, gate_up), name)
        return [target]

    @staticmethod
    def _ours(weight: torch.Tensor, gate_up: bool) -> torch.Tensor:
        """[E, out, in] with gate/up rows interleaved -> our [E, out, in], gate rows first."""
        return deinterleave(weight, 1) if gate_up else weight

    @staticmethod
    def _fill(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if param.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))

    def expected_keys(self, param_name: str) -> list[str] | None:
        return None  # every parameter is loaded whole
