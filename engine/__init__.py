"""pagedbatch's inference engine: paged KV cache, continuous batching, chunked prefill,
prefix caching. Runs standalone: `from engine import LLM, SamplingParams`.

`LLM` and `LLMEngine` are imported on first use, so that the API process can use
`SamplingParams` and the tokenizer helpers without loading torch.
"""

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured_params import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "StructuredOutputsParams",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "PoolingParams", "PoolingOutput",
           "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
