"""pagedbatch's inference engine: paged KV cache, continuous batching, chunked prefill,
prefix caching. Runs standalone: `from engine import LLM, SamplingParams`.

`LLM` and `LLMEngine` are imported on first use, so that the API process can use
`SamplingParams` and the tokenizer helpers without loading torch.
"""

from engine.beam.search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.lora.request import LoRARequest
from engine.params.outputs import CompletionOutput, Logprob, RequestOutput
from engine.params.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from engine.params.pooling_params import PoolingParams
from engine.params.sampling_params import RequestOutputKind, SamplingParams
from engine.params.structured_params import StructuredOutputsParams

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "PoolingParams",
    "PoolingOutput",
    "PoolingRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
]


def __getattr__(name: str):
    if name == "LLM":
        from engine.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.core.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
