"""The pooling state of a classify or score request on a sequence-classification model: its vector
is the head's logits through the activation vLLM applies (`use_activation`, default on): softmax over
two or more labels, sigmoid over one; a cross-encoder's score through the activation its
sentence-transformers config names (Sigmoid or Identity)."""

from __future__ import annotations

import torch

from engine.params.pooling_params import PoolingParams

CLASSIFY_TASKS = ("classify", "score")


class ClassifyState:
    classifies = True

    def __init__(
        self,
        params: PoolingParams,
        num_labels: int,
        score_activation: str | None = None,
        token_type_ids: list[int] | None = None,
    ):
        self.params = params
        self.num_labels = num_labels
        self.score_activation = score_activation
        self.token_type_ids = token_type_ids
        self.vector: torch.Tensor | None = None

    def take_logits(self, logits: torch.Tensor) -> None:
        self.vector = activate(logits.float().cpu(), self.params, self.score_activation)


def activate(logits: torch.Tensor, params: PoolingParams, score_activation: str | None) -> torch.Tensor:
    if params.use_activation is False:
        return logits
    if params.task == "score" and score_activation == "identity" and params.use_activation is None:
        return logits
    if logits.shape[-1] == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
