"""The collectives around a rank's sharded model, added to the model as it is (so that the one decoder
stays one): an all-reduce after each attention block (o_proj's partial sums over the rank's heads) and
each MLP or expert block (down_proj's over its columns; a MoE block's routed and shared experts summed
first, so one all-reduce), a vocabulary-parallel embedding (each rank looks up the ids in its slice,
the rest are zeros, and an all-reduce adds them up), and an LM head whose logits are gathered on
rank 0, where sampling runs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _all_reduce(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out)
    return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the (padded) vocabulary; `weight` stays the embedding's own
    parameter, so a tied LM head still shares it."""

    def __init__(self, weight: nn.Parameter, start: int):
        super().__init__()
        self.weight = weight
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out)
        return out


class LogitsGather:
    """A forward hook on the LM head: rank 0 gets every rank's vocabulary slice, concatenated and cut
    to the real vocabulary; the other ranks keep their own slice (which nothing reads)."""

    def __init__(self, rank: int, world: int, vocab_size: int):
        self.rank, self.world, self.vocab_size = rank, world, vocab_size

    def __call__(self, _module, _inputs, out: torch.Tensor) -> torch.Tensor:
        out = out.contiguous()
        if self.rank != 0:
            dist.gather(out, None, dst=0)
            return out
        parts = [torch.empty_like(out) for _ in range(self.world)]
        dist.gather(out, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def install(model: nn.Module, rank: int, world: int, vocab_size: int) -> None:
    """Add the collectives to `model` (a LlamaForCausalLM or MoEForCausalLM built from the rank's
    `local_config`, its weights loaded and packed)."""
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(_all_reduce)
        layer.mlp.register_forward_hook(_all_reduce)
    embed = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(embed.weight, rank * embed.weight.shape[0])
    model.lm_head.register_forward_hook(LogitsGather(rank, world, vocab_size))
