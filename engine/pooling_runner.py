"""Which runner an engine is: generative, or pooling (embeddings) with the pooler its model
directory asks for. vLLM's `runner="auto"` picks pooling for a sentence-transformers directory
or a base model saved without an LM head."""

from __future__ import annotations

from engine.config import EngineConfig, ModelConfig
from engine.model_info import read_config
from engine.sentence_transformers_config import PoolerConfig, is_sentence_transformers_dir, read_pooler_config

_BASE_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def resolve_runner(config: EngineConfig, model_config: ModelConfig) -> PoolerConfig | None:
    """Sets `config.runner` to "generate" or "pooling"; returns the pooler (None for generate)."""
    raw = read_config(model_config.path)
    if config.runner == "auto":
        base = any(a in _BASE_MODELS for a in raw.get("architectures") or [])
        config.runner = "pooling" if base or is_sentence_transformers_dir(model_config.path) else "generate"
    if config.runner == "generate":
        return None
    return read_pooler_config(model_config.path, {**raw, **(config.hf_overrides or {})})
