"""A model's `generation_config.json`, read as vLLM reads it: its EOS ids stop generation
(whatever `generation_config` says), and with `generation_config="auto"` or a path its sampling
values become the defaults of requests that bring no `SamplingParams`."""

from __future__ import annotations

from pathlib import Path

# The generation_config keys vLLM takes as sampling defaults, under SamplingParams' names.
_SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                  "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


def read_generation_config(model_path: Path, setting: str) -> dict:
    """The values generation_config.json sets to other than transformers' defaults ({} when
    there is no file). `setting` is auto, vllm (both read the model's own file) or a directory."""
    from transformers import GenerationConfig

    directory = Path(model_path) if setting in ("auto", "vllm") else Path(setting)
    if setting not in ("auto", "vllm") and not (directory / "generation_config.json").is_file():
        raise ValueError(
            f"generation_config={setting!r}: expected auto, vllm or a directory holding generation_config.json"
        )
    if not (directory / "generation_config.json").is_file():
        return {}
    try:
        return GenerationConfig.from_pretrained(str(directory)).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read {directory / 'generation_config.json'}: {exc}") from exc


def default_sampling_values(generation: dict, setting: str, overrides: dict | None) -> dict:
    """SamplingParams keyword arguments for requests without their own params."""
    values = {} if setting == "vllm" else dict(generation)
    values.update(overrides or {})
    return {ours: values[theirs] for theirs, ours in _SAMPLING_KEYS.items() if values.get(theirs) is not None}


def eos_ids(generation: dict, config_eos: list[int]) -> list[int]:
    """EOS ids from generation_config.json, else from config.json (transformers' fallback)."""
    eos = generation.get("eos_token_id", config_eos)
    return [eos] if isinstance(eos, int) else list(eos or [])
