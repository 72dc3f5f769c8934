"""Each rank's share of a model, Megatron-style: its heads (Q, and K/V, replicated where there are fewer
KV heads than ranks), its columns of gate/up and of every expert (the intermediate dimension), the
matching rows of o_proj and down_proj, and its slice of the (padded) vocabulary. `local_config` sizes
the rank's model; `ShardReader` reads only the rank's slice of each checkpoint tensor
(safetensors' `get_slice`), so that a rank never holds more than its share of the weights."""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from engine.hf.config import ModelConfig


def check_shardable(cfg: ModelConfig, world: int) -> None:
    """Raise ValueError, naming the reason, for a model this many ranks cannot split."""
    why = None
    if cfg.num_heads % world:
        why = f"its {cfg.num_heads} attention heads do not divide among {world} ranks"
    elif cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        why = f"its {cfg.num_kv_heads} KV heads neither divide among {world} ranks nor replicate evenly"
    elif cfg.intermediate_size % world:
        why = f"its intermediate size {cfg.intermediate_size} does not divide among {world} ranks"
    elif cfg.moe is not None and any(size % world for size in _moe_sizes(cfg)):
        why = f"its experts' intermediate sizes {_moe_sizes(cfg)} do not divide among {world} ranks"
    elif cfg.mla is not None:
        why = "its latent attention (MLA) is not split across ranks"
    elif cfg.qk_norm_scope == "all":
        why = "its q/k norms span every head (OLMo 2), which would need one more all-reduce per layer"
    elif world > 1 and cfg.attn_sinks:
        why = "gpt-oss's attention sinks and expert biases are not split across ranks yet"
    if why:
        raise ValueError(f"tensor_parallel_size={world} cannot split {cfg.architecture}: {why}")


def _moe_sizes(cfg: ModelConfig) -> list[int]:
    return [s for s in (cfg.moe.expert_intermediate_size, cfg.moe.shared_expert_intermediate_size) if s]


def padded_vocab(cfg: ModelConfig, world: int) -> int:
    return -(-cfg.vocab_size // world) * world


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's model: its heads, its columns, its vocabulary slice."""
    check_shardable(cfg, world)
    moe = cfg.moe
    if moe is not None:
        moe = replace(
            moe,
            expert_intermediate_size=moe.expert_intermediate_size // world,
            shared_expert_intermediate_size=(moe.shared_expert_intermediate_size or 0) // world
            or moe.shared_expert_intermediate_size,
        )
    return replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=max(cfg.num_kv_heads // world, 1),
        intermediate_size=cfg.intermediate_size // world,
        vocab_size=padded_vocab(cfg, world) // world,
        moe=moe,
    )


_COLUMNS = re.compile(r"\.(gate_proj|up_proj|w1|w3)\.weight$")  # split by output rows
_ROWS = re.compile(r"\.(o_proj|down_proj|w2)\.weight$")  # split by input columns
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


class ShardReader:
    """`read(handle, checkpoint name, our name)`: the rank's slice of one checkpoint tensor."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        d = cfg.head_dim
        q_local = cfg.num_heads // world * d
        self.q = (rank * q_local, q_local)
        if cfg.num_kv_heads >= world:
            kv_local = cfg.num_kv_heads // world * d
            self.kv = (rank * kv_local, kv_local)
        else:  # the one KV head this rank's query heads share, replicated on the ranks that use it
            group = cfg.num_heads // cfg.num_kv_heads
            self.kv = (rank * (cfg.num_heads // world) // group * d, d)
        self.vocab_local = padded_vocab(cfg, world) // world

    def _part(self, size: int) -> tuple[int, int]:
        local = size // self.world
        return self.rank * local, local

    def __call__(self, f, tensor_name: str, name: str) -> torch.Tensor:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        sl = f.get_slice(tensor_name)
        shape = sl.get_shape()
        if m := _FUSED_EXPERTS.search(name):  # [E, 2I, H] gate rows first, or [E, H, I]
            if m[1] == "gate_up_proj":
                return self._halves(sl, shape[1], dim=1)
            return _take(sl, 2, *self._part(shape[2]))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return self._vocab(sl, shape)
        if ".q_proj." in name:
            return _take(sl, 0, *self.q)
        if ".k_proj." in name or ".v_proj." in name:
            return _take(sl, 0, *self.kv)
        if name.endswith(".qkv_proj.weight") or name.endswith(".qkv_proj.bias"):  # fused in the checkpoint
            q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
            return torch.cat(
                [
                    _take(sl, 0, *self.q),
                    _take(sl, 0, q + self.kv[0], self.kv[1]),
                    _take(sl, 0, q + kv + self.kv[0], self.kv[1]),
                ]
            )
        if name.endswith(".gate_up_proj.weight"):  # fused dense gate/up (Phi-3)
            return self._halves(sl, shape[0], dim=0)
        if _COLUMNS.search(name):
            return _take(sl, 0, *self._part(shape[0]))
        if _ROWS.search(name):
            return _take(sl, 1, *self._part(shape[1]))
        if name.endswith(".o_proj.bias"):  # added once, after the all-reduce: rank 0's alone
            full = sl[:]
            return full if self.rank == 0 else torch.zeros_like(full)
        return sl[:]

    def _halves(self, sl, size: int, dim: int) -> torch.Tensor:
        half = size // 2
        start, local = self._part(half)
        return torch.cat([_take(sl, dim, start, local), _take(sl, dim, half + start, local)], dim=dim)

    def _vocab(self, sl, shape) -> torch.Tensor:
        start = self.rank * self.vocab_local
        end = min(start + self.vocab_local, shape[0])
        rows = sl[start:end] if end > start else torch.empty(0, *shape[1:])
        if rows.shape[0] < self.vocab_local:  # the padding past the vocabulary: never looked up
            rows = torch.cat([rows, rows.new_zeros(self.vocab_local - rows.shape[0], *shape[1:])])
        return rows


def _take(sl, dim: int, start: int, length: int) -> torch.Tensor:
    index = (slice(None),) * dim + (slice(start, start + length),)
    return sl[index]
