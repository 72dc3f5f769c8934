"""A model's `generation_config.json`, read as vLLM reads it: its EOS ids stop generation
(whatever `generation_config` says), and with `generation_config="auto"` or a path its sampling
values become the defaults of requests that bring no `SamplingParams`."""

from __future__ import annotations

import json
from pathlib import Path

# The generation_config keys vLLM takes as sampling defaults, under SamplingParams' names.
_SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(model_path: Path, setting: str) -> dict:
    """The values generation_config.json sets to other than transformers' defaults ({} when
    there is no file). `setting` is auto, vllm (both read the model's own file) or a directory."""
    directory = Path(model_path) if setting in ("auto", "vllm") else Path(setting)
    if setting not in ("auto", "vllm") and not (directory / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config={setting!r}: expected auto, vllm or a directory holding generation_config.json"
        )
    if not (directory / "generation_config.json").is_file():
        return {}
    try:
        raw = json.loads((directory / "generation_config.json").read_text(encoding="utf-8"))
        if isinstance(raw, dict) and not raw.keys() & _SAMPLING_KEYS.keys():
            # only the EOS ids matter here: no need for transformers (a second to import) to tell defaults apart
            return {} if raw.get("eos_token_id") is None else {"eos_token_id": raw["eos_token_id"]}
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(directory)).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read {directory / 'generation_config.json'}: {exc}") from exc


def default_sampling_values(generation: dict, setting: str, overrides: dict | None) -> dict:
    """SamplingParams keyword arguments for requests without their own params."""
    values = {} if setting == "vllm" else dict(generation)
    values.update(overrides or {})
    return {ours: values[theirs] for theirs, ours in _SAMPLING_KEYS.items() if values.get(theirs) is not None}


def split_eos_ids(tokenizer_eos: int | None, eos: list[int]) -> tuple[int | None, set[int]]:
    """The tokenizer's EOS (stop_reason None) and generation_config's other EOS ids, which stop like
    stop_token_ids (stop_reason: the id), as in vLLM."""
    extra = set(eos)
    primary = tokenizer_eos if tokenizer_eos is not None else (min(extra) if extra else None)
    return primary, extra - {primary}


def eos_ids(generation: dict, config_eos: list[int]) -> list[int]:
    """EOS ids from generation_config.json, else from config.json (transformers' fallback)."""
    eos = generation.get("eos_token_id", config_eos)
    return [eos] if isinstance(eos, int) else list(eos or [])
