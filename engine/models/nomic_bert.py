"""NomicBERT as transformers 5 reads and writes it (`NomicBertModel`, the original weight names):
word and token-type embeddings, then post-LayerNorm layers of rotary attention (no biases) and a
SwiGLU MLP; q, k and v are one fused linear, gate and up another."""

from __future__ import annotations

import torch
from torch import nn

from engine.hf.encoder_config import EncoderConfig
from engine.models.encoder_attention import PackedBatch, activation, packed_attention
from engine.models.modernbert import _rotate


class NomicBertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.self_attn = nn.Module()
        self.self_attn.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.self_attn.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.post_mlp_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x, cos, sin, batch: PackedBatch):
        qkv = self.self_attn.qkv(x).view(-1, 3, self.num_heads, self.head_dim)
        rotate = lambda q, k: (_rotate(q, cos, sin), _rotate(k, cos, sin))  # noqa: E731
        x = self.post_attention_layernorm(
            x + self.self_attn.o_proj(packed_attention(qkv, batch, self.head_dim**-0.5, None, rotate))
        )
        gate, up = self.mlp.gate_up(x).chunk(2, dim=-1)
        return self.post_mlp_layernorm(x + self.mlp.down_proj(self.act(gate) * up))


class NomicBertEncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embeddings.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.embeddings.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(cfg) for _ in range(cfg.num_layers))
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        self.register_buffer("inv_freq", (1.0 / cfg.layer_thetas[0] ** half).float(), persistent=False)

    def forward(self, input_ids, token_type_ids, batch: PackedBatch) -> torch.Tensor:
        starts = torch.tensor(batch.starts, device=input_ids.device)
        lengths = torch.tensor(batch.lengths, device=input_ids.device)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device) - torch.repeat_interleave(starts, lengths)
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        x = self.embeddings.word_embeddings(input_ids) + self.embeddings.token_type_embeddings(token_type_ids)
        x = self.embeddings.LayerNorm(x)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        return x

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """transformers' names, or the original ones it saves under (emb_ln, encoder.layers.N.attn.Wqkv,
        mlp.fc11 (up) / fc12 (gate) / fc2, norm1, norm2)."""
        if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
            return None
        name = name.replace("emb_ln.", "embeddings.LayerNorm.").replace("encoder.layers.", "layers.")
        for old, new in (
            (".attn.Wqkv.", ".self_attn.qkv."),
            (".attn.out_proj.", ".self_attn.o_proj."),
            (".mlp.fc12.", ".mlp.gate_proj."),
            (".mlp.fc11.", ".mlp.up_proj."),
            (".mlp.fc2.", ".mlp.down_proj."),
            (".norm1.", ".post_attention_layernorm."),
            (".norm2.", ".post_mlp_layernorm."),
        ):
            name = name.replace(old, new)
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".self_attn.{part}." in name:
                return name.replace(f".self_attn.{part}.", ".self_attn.qkv."), i
        for i, part in enumerate(("gate_proj", "up_proj")):
            if f".mlp.{part}." in name:
                return name.replace(f".mlp.{part}.", ".mlp.gate_up."), (i, 2)
        return name, None
