"""vLLM's `LLM(...)` keyword arguments that this engine has no use for: each is accepted when it
asks for what the engine does anyway (a documented no-op), or refused with a ValueError that
names it and says why. Engine options (`EngineConfig` fields) pass straight through."""

from __future__ import annotations

import dataclasses

from engine.hf.config import EngineConfig

# Accepted with any value: they tune logging, memory swapping or compilation the engine does not have.
_NO_OPS = {
    "disable_log_stats": "there are no periodic stats logs",
    "swap_space": "preempted sequences are recomputed, never swapped to CPU memory",
    "enable_chunked_prefill": "prefill is always chunked; outputs are the same either way",
    "trust_remote_code": "only built-in architectures load; no remote code is ever run",
    "max_seq_len_to_capture": "CUDA graphs cover decode batches up to cuda_graph_max_batch",
    "disable_custom_all_reduce": "tensor parallelism all-reduces through torch.distributed only",
    "distributed_executor_backend": "tensor-parallel ranks are always processes (engine/parallel)",
    "compilation_config": "the engine compiles nothing beyond its Triton kernels",
    "download_dir": "hub models go to the Hugging Face cache",
}

# Accepted only with the value that means what this engine does; anything else is refused.
_ONLY = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not supported"),
    "data_parallel_size": (1, "data parallelism is not supported; run several workers instead"),
    "kv_cache_dtype": ("auto", "the KV cache is stored in the model's dtype"),
    "cpu_offload_gb": (0, "weights are not offloaded to CPU memory"),
    "skip_tokenizer_init": (False, "the engine needs the tokenizer (stop strings, chat templates)"),
    "load_format": ("auto", "weights load from safetensors only"),
    "task": ("auto", "only text generation and embeddings (task='embed') are supported"),
    "speculative_config": (None, "speculative decoding is not supported"),
    "allowed_local_media_path": (
        "",
        "images are not read from local files (file:// URLs); pass them as data: or http(s) URLs or PIL images",
    ),
}
_EQUIVALENT = {"task": {"generate"}, "load_format": {"safetensors"}, "allowed_local_media_path": {None}}

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model"}


def engine_kwargs(kwargs: dict) -> dict:
    """The EngineConfig options among `kwargs`; raises ValueError for a refused or unknown one."""
    options = {}
    for name, value in kwargs.items():
        if name in ENGINE_FIELDS:
            options[name] = value
        elif name == "task" and value in ("embed", "encode"):  # vLLM's older spelling of runner="pooling"
            options["runner"] = "pooling"
        elif name in _ONLY:
            wanted, why = _ONLY[name]
            if value != wanted and value not in _EQUIVALENT.get(name, ()):
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        elif name not in _NO_OPS:
            raise ValueError(f"unknown LLM argument {name!r}")
    return options
