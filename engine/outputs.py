"""vLLM's module path `vllm.outputs`, kept for code written against it; the types live in
`engine.params` (`outputs`, `pooling_outputs`, `scoring_outputs`)."""

from engine.params.outputs import CompletionOutput, Logprob, RequestOutput
from engine.params.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from engine.params.scoring_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
