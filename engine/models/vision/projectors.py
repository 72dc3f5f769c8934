"""The projectors from a vision tower's features into the language model's embedding space: LLaVA's
two-layer MLP, and Gemma 3's pooled projector (average pooling of the patch grid down to
mm_tokens_per_image, RMSNorm with (1 + w) weights — the soft-embedding norm — then one matrix)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class SoftEmbeddingNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    def __init__(self, vision: dict, text_hidden: int, tokens_per_image: int, eps: float):
        super().__init__()
        hidden = vision["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden))
        self.mm_soft_emb_norm = SoftEmbeddingNorm(hidden, vision.get("layer_norm_eps", 1e-6))
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(tokens_per_image**0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(features)
