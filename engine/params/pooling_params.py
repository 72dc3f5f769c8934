"""vLLM's `PoolingParams`: what an embedding request asks of the pooler (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.params.pooling_truncation import SIDES


@dataclass
class PoolingParams:
    """`dimensions`: keep the first N values (Matryoshka models only), then renormalize.
    `normalize`: L2-normalize the vector; None means what the model says (its
    sentence-transformers Normalize module, or True for a plain causal model, as vLLM).
    `truncate_prompt_tokens`: cut a longer prompt to N tokens (-1: the model's context), keeping
    its first ones (`truncation_side` "right", the default of vLLM's pooling runner and what
    sentence-transformers does) or its last ("left"); a text keeps its tokenizer's special
    tokens (`engine.params.pooling_truncation`)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"
    truncation_side: str = "right"
    use_activation: bool | None = None  # classify/score: the head's activation (None: the model's default)

    def validate(self) -> None:
        if self.task not in ("embed", "encode", "classify", "score"):
            raise ValueError(f"pooling task {self.task!r} is not supported; use embed, classify or score")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a boolean, got {self.use_activation!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or (keep < 1 and keep != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {keep!r}")
        if self.truncation_side not in SIDES:
            raise ValueError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}")

    def clone(self) -> PoolingParams:
        return PoolingParams(
            self.dimensions,
            self.normalize,
            self.truncate_prompt_tokens,
            self.task,
            self.truncation_side,
            self.use_activation,
        )
