"""BERT and RoBERTa / XLM-RoBERTa encoders (absolute positions, token types, post-LayerNorm), with
the sequence-classification heads of `BertForSequenceClassification` (pooler, then classifier) and
`(XLM)RobertaForSequenceClassification` (dense, tanh, out_proj on the first token). Module names
follow transformers' so that checkpoints load by name; query, key and value are one fused linear."""

from __future__ import annotations

import torch
from torch import nn

from engine.hf.encoder_config import EncoderConfig
from engine.models.encoder_attention import PackedBatch, activation, dense_act, dense_add, packed_attention


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, input_ids, positions, token_type_ids):
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, x, batch: PackedBatch):
        ctx = packed_attention(self.qkv(x).view(-1, 3, self.num_heads, self.head_dim), batch, self.head_dim**-0.5)
        return self.output.LayerNorm(dense_add(self.output.dense, ctx, x))


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        activation(cfg.hidden_act)  # an unsupported one fails at load
        self.hidden_act = cfg.hidden_act

    def forward(self, x, batch: PackedBatch):
        x = self.attention(x, batch)
        hidden = dense_act(self.intermediate.dense, x, self.hidden_act)
        return self.output.LayerNorm(dense_add(self.output.dense, hidden, x))


class BertEncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        if cfg.classifier and cfg.family == "bert":
            self.pooler = nn.Module()
            self.pooler.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        elif cfg.classifier:
            self.classifier = nn.Module()
            self.classifier.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
            self.classifier.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def positions(self, input_ids: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """BERT: 0, 1, ... per sequence. RoBERTa: the padding id + 1 onwards, counting only
        non-padding tokens (a padding token itself sits at the padding id), as transformers does."""
        starts = torch.tensor(batch.starts, device=input_ids.device)
        lengths = torch.tensor(batch.lengths, device=input_ids.device)
        if self.cfg.family == "bert":
            first = torch.repeat_interleave(starts, lengths)
            return torch.arange(input_ids.shape[0], device=input_ids.device) - first
        pad = self.cfg.pad_token_id
        mask = (input_ids != pad).long()
        counts = mask.cumsum(0)
        before = torch.repeat_interleave(counts[starts] - mask[starts], lengths)
        return (counts - before) * mask + pad

    def forward(self, input_ids, token_type_ids, batch: PackedBatch) -> torch.Tensor:
        x = self.embeddings(input_ids, self.positions(input_ids, batch), token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def classify(self, hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """[sequences, num_labels] logits from each sequence's first token."""
        first = hidden[torch.tensor(batch.starts, device=hidden.device)]
        if self.cfg.family == "bert":
            return self.classifier(torch.tanh(self.pooler.dense(first)))
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))

    def checkpoint_name(self, name: str) -> tuple[str, int | None] | None:
        """Where checkpoint weight `name` goes: (parameter, shard of the fused qkv or None), or None
        for a weight this model does not use (a base model's pooler, an MLM head, position ids)."""
        for prefix in ("bert.", "roberta."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith(("cls.", "lm_head.")) or name.endswith(("position_ids", "token_type_ids")):
            return None
        if name.startswith("pooler.") and not hasattr(self, "pooler"):
            return None
        for i, part in enumerate(("query", "key", "value")):
            marker = f".attention.self.{part}."
            if marker in name:
                return name.replace(marker, ".attention.qkv."), i
        return name, None
