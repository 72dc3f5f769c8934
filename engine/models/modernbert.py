"""ModernBERT: pre-norm layers without biases, rotary positions (one theta for global layers, another
for local ones), every third layer global and the others attending within a sliding window, a GeGLU
MLP; and `ModernBertForSequenceClassification`'s head (CLS or mean, dense, activation, norm,
classifier). Module names follow transformers' so that checkpoints load by name."""

from __future__ import annotations

import torch
from torch import nn

from engine.hf.encoder_config import EncoderConfig
from engine.models.encoder_attention import PackedBatch, activation, packed_attention


def _norm(cfg: EncoderConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] rotated by halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig, window: int | None):
        super().__init__()
        self.num_heads, self.head_dim, self.window = cfg.num_heads, cfg.head_dim, window
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, batch: PackedBatch):
        qkv = self.Wqkv(x).view(-1, 3, self.num_heads, self.head_dim)
        rotate = lambda q, k: (_rotate(q, cos, sin), _rotate(k, cos, sin))  # noqa: E731
        return self.Wo(packed_attention(qkv, batch, self.head_dim**-0.5, self.window, rotate))


class ModernBertMLP(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x):
        inputs, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inputs) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig, index: int):
        super().__init__()
        self.attn_norm = nn.Identity() if index == 0 else _norm(cfg)
        self.attn = ModernBertAttention(cfg, cfg.layer_windows[index])
        self.mlp_norm = _norm(cfg)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x, cos, sin, batch: PackedBatch):
        x = x + self.attn(self.attn_norm(x), cos, sin, batch)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embeddings.norm = _norm(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg)
        self.thetas = sorted(set(cfg.layer_thetas))
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        for i, theta in enumerate(self.thetas):
            self.register_buffer(f"inv_freq_{i}", (1.0 / theta**half).float(), persistent=False)
        if cfg.classifier:
            self.head = nn.Module()
            self.head.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
            self.head.norm = _norm(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
            self.head_act = activation(cfg.classifier_activation)

    def _cos_sin(self, positions: torch.Tensor) -> dict[float, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for i, theta in enumerate(self.thetas):
            angles = positions.float()[:, None] * getattr(self, f"inv_freq_{i}")[None, :]
            angles = torch.cat((angles, angles), dim=-1)[:, None, :]
            out[theta] = angles.cos(), angles.sin()
        return out

    def forward(self, input_ids, token_type_ids, batch: PackedBatch) -> torch.Tensor:
        starts = torch.tensor(batch.starts, device=input_ids.device)
        lengths = torch.tensor(batch.lengths, device=input_ids.device)
        positions = torch.arange(input_ids.shape[0], device=input_ids.device) - torch.repeat_interleave(starts, lengths)
        tables = self._cos_sin(positions)
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        for layer, theta in zip(self.layers, self.cfg.layer_thetas):
            cos, sin = tables[theta]
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), batch)
        return self.final_norm(x)

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        if self.cfg.classifier_pooling == "cls":
            pooled = hidden[torch.tensor(batch.starts, device=hidden.device)]
        else:
            pooled = torch.stack([hidden[s : s + n].mean(0) for s, n in zip(batch.starts, batch.lengths)])
        return self.classifier(self.head.norm(self.head_act(self.head.dense(pooled))))

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith(("decoder.", "head.")) and not self.cfg.classifier:
            return None  # the masked-LM head of a ModernBertForMaskedLM checkpoint
        return name, None
