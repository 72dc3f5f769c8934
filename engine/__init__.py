"""pagedbatch's inference engine: paged KV cache, continuous batching, chunked prefill,
prefix caching. Runs standalone: `from engine import LLM, SamplingParams`.

`LLM` and `LLMEngine` are imported on first use, so that the API process can use
`SamplingParams` and the tokenizer helpers without loading torch.
"""

import os

# OpenMP threads that spin at every barrier burn the cores they share with other processes:
# on a busy 2-core host a 2-thread step ran ~6x the CPU time of a 1-thread one. Sleeping
# waits keep both threads without that. Read when torch loads its OpenMP runtime, so only
# effective if `engine` is imported before torch; a value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
