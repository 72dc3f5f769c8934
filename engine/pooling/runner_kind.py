"""Which runner an engine is: generative, or pooling (embeddings) with the pooler its model
directory asks for. vLLM's `runner="auto"` picks pooling for a sentence-transformers directory
or a base model saved without an LM head."""

from __future__ import annotations

from engine.hf.config import EngineConfig, ModelConfig
from engine.hf.model_info import read_config
from engine.hf.sentence_transformers_config import PoolerConfig, default_runner, read_pooler_config


def resolve_runner(config: EngineConfig, model_config: ModelConfig) -> PoolerConfig | None:
    """Sets `config.runner` to "generate" or "pooling"; returns the pooler (None for generate)."""
    raw = read_config(model_config.path)
    if config.runner == "auto":
        config.runner = default_runner(model_config.path, raw)
    if config.runner == "generate":
        return None
    return read_pooler_config(model_config.path, {**raw, **(config.hf_overrides or {})})
