"""What the engine hands back for a pooled (embedding) request, in vLLM's shapes
(`vllm/outputs.py`: PoolingRequestOutput, EmbeddingRequestOutput). Torch-free: `data` is
whatever tensor the pooler made (float32, on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [dimensions], float32


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            out.request_id,
            EmbeddingOutput(out.outputs.data.tolist()),
            out.prompt_token_ids,
            out.finished,
            out.num_cached_tokens,
            out.prompt,
        )
