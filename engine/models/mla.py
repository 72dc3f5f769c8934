"""DeepSeek's multi-head latent attention over a compressed paged KV cache.

Per token, the cache holds one entry [c_kv | k_pe] of kv_lora_rank + qk_rope_head_dim values: the
normed latent c_kv = kv_a_layernorm(x W_kv_a) and the rotated key part k_pe shared by every head.
A head's key is [c_kv W_UK_h | k_pe] and its value c_kv W_UV_h (W_UK_h, W_UV_h: its rows of
kv_b_proj), so with the up-projections absorbed into the query and the output,

    q_h . k_h = [q_nope_h W_UK_h | q_pe_h] . [c_kv | k_pe]    and    out_h = (sum_s p_s c_kv_s) W_UV_h^T,

attention runs directly on the cache entries, as multi-query attention with one KV head of the
entry's width whose values are the entries themselves (the first kv_lora_rank features of the result
are the weighted latent; the rest, the weighted k_pe, is dropped). Nothing is decompressed: prefill,
chunked prefill, prefix-cache hits and decode all take the paged kernels as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.hf.config import ModelConfig
from engine.models.llama import AttentionInputs, RMSNorm
from engine.runner.ops import Ops

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm keep RMSNorm's default, not rms_norm_eps


class Weight(nn.Module):
    """A bare weight under a linear layer's checkpoint name (`<name>.weight`), read as a matrix, never
    called: the CPU's packed linears would drop it."""

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary features in pairs (x0, x1), (x2, x3), .. as (x0, x2, ..), (x1, x3, ..), the halves the
    rotary kernels rotate: DeepSeek's interleaved RoPE, as transformers computes it. Queries and
    keys take the same permutation, so their dot products are unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttention(nn.Module):
    local_rope = False  # one rotary table for every layer

    def __init__(self, cfg: ModelConfig, layer: int, ops: Ops):
        super().__init__()
        mla = cfg.mla
        self.layer, self.ops, self.scale = layer, ops, cfg.attn_scale
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        self.v_dim = mla.v_head_dim
        self.interleaved = mla.rope_interleave
        q_size = self.num_heads * (self.nope + self.rope)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=mla.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, mla.cache_width, bias=mla.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Weight(self.num_heads * (self.nope + self.v_dim), self.rank)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=mla.attention_bias)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        tokens = x.shape[0]
        q_nope, q_pe = self._queries(x).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.ops.apply_rotary(
            q_pe.contiguous(), k_pe.reshape(tokens, 1, self.rope), inputs.positions, cos_sin
        )
        entry = torch.cat((self.kv_a_layernorm(c_kv.contiguous()).unsqueeze(1), k_pe), dim=-1)  # [T, 1, width]
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1)
        cache = inputs.kv_caches[self.layer][0]
        self.ops.write_kv_cache(entry, entry, cache, cache, inputs.slot_mapping)
        out = self.ops.paged_attention(
            query.contiguous(),
            cache,
            cache,
            inputs.block_tables,
            inputs.seq_lens,
            inputs.query_start_loc,
            self.scale,
            **inputs.attention_kwargs(),
        ).view(tokens, self.num_heads, self.rank + self.rope)
        heads = torch.bmm(out[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v_dim]
        return self.o_proj(heads.transpose(0, 1).reshape(tokens, self.num_heads * self.v_dim))
