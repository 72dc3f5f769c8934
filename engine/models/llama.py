"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one module with switches:
QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, any GQA ratio.

Q, K and V are one fused projection, as are gate and up; the loader packs the
checkpoint's separate weights into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.rotary import cos_sin_cache
from engine.ops import Ops


@dataclass
class AttentionInputs:
    """Flat per-step tensors describing where each new token's K/V lives."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Optional host-side hints for kernels that take them (the Triton set; the torch reference
    # takes none): set, they are passed to paged_attention as keyword arguments. A CUDA-graph
    # decode sets all three so that the captured launches fit every replay.
    max_query_len: int | None = None
    max_seq_len: int | None = None
    attn_out: torch.Tensor | None = None  # [T, H, D] output buffer shared by every layer

    def attention_kwargs(self) -> dict:
        hints = {"max_query_len": self.max_query_len, "max_seq_len": self.max_seq_len, "out": self.attn_out}
        return {k: v for k, v in hints.items() if v is not None}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops):
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x: torch.Tensor, positions, cos_sin: torch.Tensor):
        """Queries, keys and values of `x` ([tokens, heads, head_dim]), normed and rotated."""
        return self.split_qkv(self.qkv_proj(x), positions, cos_sin)

    def split_qkv(self, qkv: torch.Tensor, positions, cos_sin: torch.Tensor):
        """`project_qkv` from the fused projection `qkv` (the lean pooling forward computes it itself)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.apply_rotary(q, k, positions, cos_sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.project_qkv(x, inputs.positions, cos_sin)
        k_cache, v_cache = inputs.kv_caches[self.layer]
        self.ops.write_kv_cache(k, v, k_cache, v_cache, inputs.slot_mapping)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, self.scale,
            **inputs.attention_kwargs(),
        )
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, layer, ops)
        self.mlp = MLP(cfg, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, residual, cos_sin, inputs):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, inputs)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, make_mlp=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops, make_mlp and make_mlp(cfg, i, ops))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Packed checkpoint names: (our parameter, shard index) for each separate weight."""

    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, ops, self.make_mlp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cache = cos_sin_cache(cfg.head_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin", cache, persistent=False)

    make_mlp = None  # subclasses: (cfg, layer, ops) -> a layer's MLP, or None for the dense one

    def shard_sizes(self, packed_name: str) -> list[int]:
        cfg = self.cfg
        if packed_name == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def forward(self, input_ids: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Hidden states of every token, [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, self.cos_sin, inputs)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
