"""vLLM's module path `vllm.sampling_params`, kept for code written against it; the types live in
`engine.params.sampling_params`."""

from engine.params.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = ["SamplingParams", "RequestOutputKind", "BeamSearchParams", "GuidedDecodingParams", "StructuredOutputsParams"]
