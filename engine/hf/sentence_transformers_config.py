"""How a model directory says to pool: sentence-transformers' files (`modules.json`,
`1_Pooling/config.json`, `config_sentence_transformers.json`) and the Matryoshka declaration in
`config.json` (torch-free). From `sentence_bert_config.json`, `do_lower_case` is read here; its
`max_seq_length` caps the context length, read in `engine.hf.model_info`.

Supported: one Transformer module, then Pooling (last-token, mean or CLS), then Dense layers and an
optional Normalize. Anything else (max pooling, weighted means) is refused by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.hf.encoder_config import encoder_architecture

POOLING_METHODS = ("LAST", "MEAN", "CLS")

# sentence-transformers' mode names (the `pooling_mode` string of v5+, the booleans before it).
_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_OLD_FLAGS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_OLD_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass
class PoolerConfig:
    method: str = "LAST"  # vLLM's default for a causal model run as an embedder
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    matryoshka_dimensions: list[int] | None = None  # None: any size up to hidden (is_matryoshka)
    is_matryoshka: bool = False
    do_lower_case: bool = False  # texts are lowercased before tokenizing (after the default prompt)
    from_sentence_transformers: bool = False
    # the Dense modules' directories, in order (engine.pooling.st_dense)
    dense: list[Path] = field(default_factory=list)
    dense_output_size: int | None = None  # the vector's size after them

    @property
    def default_prompt(self) -> str:
        return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states a cached prefix would skip."""
        return self.method != "LAST"

    def check_dimensions(self, dimensions: int, hidden_size: int) -> None:
        if not self.is_matryoshka:
            raise ValueError(
                f"this model does not support Matryoshka embeddings: dimensions={dimensions} "
                "cannot be honoured (config.json declares no is_matryoshka/matryoshka_dimensions)"
            )
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions={dimensions} is not one of the model's Matryoshka sizes {allowed}")
        if dimensions > hidden_size:
            raise ValueError(f"dimensions={dimensions} exceeds the model's embedding size of {hidden_size}")


BASE_MODELS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")


def is_sentence_transformers_dir(path: Path) -> bool:
    return (Path(path) / "modules.json").is_file()


def default_runner(path: Path, raw_config: dict) -> str:
    """vLLM's runner="auto": pooling for a sentence-transformers directory, a base model saved
    without an LM head or an encoder, generate otherwise."""
    base = any(a in BASE_MODELS for a in raw_config.get("architectures") or []) or encoder_architecture(raw_config)
    return "pooling" if base or is_sentence_transformers_dir(path) else "generate"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def _pooling_method(raw: dict) -> str:
    if "pooling_mode" in raw:
        modes = raw["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
        if len(modes) != 1 or modes[0] not in _MODE_NAMES:
            raise ValueError(f"pooling mode {raw['pooling_mode']!r} is not supported; supported: {sorted(_MODE_NAMES)}")
        return _MODE_NAMES[modes[0]]
    if any(raw.get(flag) for flag in _OLD_UNSUPPORTED):
        raise ValueError(f"pooling modes {[f for f in _OLD_UNSUPPORTED if raw.get(f)]} are not supported")
    chosen = [method for flag, method in _OLD_FLAGS.items() if raw.get(flag)]
    if len(chosen) != 1:
        raise ValueError(f"expected exactly one pooling mode in the Pooling config, got {chosen or 'none'}")
    return chosen[0]


def _module_kind(entry: dict) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def read_pooler_config(path: Path, raw_config: dict) -> PoolerConfig:
    """The pooler a model directory asks for; raises ValueError for what cannot be served."""
    path = Path(path)
    cfg = PoolerConfig()
    if raw_config.get("is_causal") is False or raw_config.get("use_bidirectional_attention"):
        raise ValueError(
            "bidirectional attention is not supported: the paged attention kernels are causal "
            "only (Llama/Qwen2/Qwen3 embedding models with causal attention are)"
        )
    dims = raw_config.get("matryoshka_dimensions")
    cfg.is_matryoshka = bool(raw_config.get("is_matryoshka") or dims)
    cfg.matryoshka_dimensions = sorted(dims) if dims else None
    if encoder_architecture(raw_config):
        cfg.method = "CLS"  # vLLM's default for a BERT-like embedder without sentence-transformers' files
    if not is_sentence_transformers_dir(path):
        return cfg
    cfg.from_sentence_transformers = True
    modules = _read_json(path / "modules.json")
    kinds = [_module_kind(m) for m in modules]
    tail = kinds[2:-1] if kinds[-1:] == ["Normalize"] and len(kinds) > 2 else kinds[2:]
    if not kinds or kinds[0] != "Transformer" or kinds[1:2] != ["Pooling"] or any(k != "Dense" for k in tail):
        raise ValueError(
            f"sentence-transformers modules {kinds} are not supported; "
            "expected Transformer, Pooling, Dense layers and an optional Normalize"
        )
    cfg.dense = [path / m.get("path", "") for m, k in zip(modules, kinds) if k == "Dense"]
    if cfg.dense:
        cfg.dense_output_size = _read_json(cfg.dense[-1] / "config.json").get("out_features")
    pooling_dir = path / (modules[1].get("path") or "1_Pooling")
    pooling = _read_json(pooling_dir / "config.json")
    cfg.method = _pooling_method(pooling)
    if pooling.get("include_prompt") is False:
        raise ValueError("Pooling with include_prompt=false is not supported")
    cfg.normalize = kinds[-1] == "Normalize"
    st_file = path / "config_sentence_transformers.json"
    if st_file.is_file():
        st = _read_json(st_file)
        cfg.prompts = dict(st.get("prompts") or {})
        cfg.default_prompt_name = st.get("default_prompt_name")
    bert_file = path / "sentence_bert_config.json"
    if bert_file.is_file():
        cfg.do_lower_case = bool(_read_json(bert_file).get("do_lower_case", False))
    return cfg
