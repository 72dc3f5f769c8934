"""What a model's Hugging Face `config.json` says, read without torch.

The engine (`ModelConfig`) and the request validator (`batchfile.ModelLimits`) both read the
context length here, so a request the validator accepts always fits the engine that runs it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

# Where a sentence-transformers model directory puts `max_seq_length` (vLLM reads the same files).
SENTENCE_TRANSFORMERS_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
# The key under which `read_config` carries it into the config.
MAX_SEQ_LENGTH = "sentence_transformers_max_seq_length"


def read_config(model_dir: str | Path) -> dict:
    """The parsed `config.json` of a local model directory, with sentence-transformers'
    `max_seq_length` (its first file that has one) under MAX_SEQ_LENGTH where there is one."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.exists():
        raise ValueError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    config = json.loads(config_file.read_text())
    for name in SENTENCE_TRANSFORMERS_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            try:
                value = json.loads(path.read_text()).get("max_seq_length")
            except (OSError, ValueError, AttributeError) as exc:
                raise ValueError(f"cannot read {path}: {exc}") from exc
            if value is not None:
                config[MAX_SEQ_LENGTH] = value
                break
    return config


def _text_config(config: Mapping) -> Mapping:
    """The language model's part of a config: the config itself, or the `text_config` of a
    multimodal one."""
    inner = config.get("text_config")
    if "max_position_embeddings" not in config and isinstance(inner, Mapping):
        return inner
    return config


def context_length(config: Mapping, max_model_len: int | None = None) -> int:
    """The longest sequence (prompt plus output) the model takes: `max_position_embeddings`
    (a `sliding_window` does not cap it: windowed layers slide), capped by sentence-transformers'
    `max_seq_length` (as vLLM: the length the model was trained to embed), then by `max_model_len`.

    A config without `max_position_embeddings` is an error rather than a guess: transformers'
    default differs per architecture (2,048 for Llama, 32,768 for Qwen2), and `save_pretrained`
    always writes the key.
    """
    cfg = _text_config(config)
    length = cfg.get("max_position_embeddings")
    if not _positive_int(length):
        raise ValueError("config.json has no usable max_position_embeddings")
    source = ""
    st_length = config.get(MAX_SEQ_LENGTH)
    if st_length is not None:
        if not _positive_int(st_length):
            raise ValueError(f"sentence-transformers' max_seq_length must be a positive integer, got {st_length!r}")
        if st_length < length:
            length, source = st_length, " (sentence-transformers' max_seq_length)"
    if max_model_len is not None:
        if max_model_len > length:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length {length}{source}")
        length = max_model_len
    return length


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
