"""Write tiny random-weight sentence-transformers model directories (embedding tests, the
README example, benchmarks). The layout is the one sentence-transformers reads: the base
model's config and weights (no LM head) and tokenizer at the top, `modules.json`,
`1_Pooling/config.json`, an optional `2_Normalize`, `config_sentence_transformers.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.testing.tiny import build_tokenizer, tiny_config

POOLING_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_tiny_embedding_model(
    path,
    arch: str = "qwen3",
    pooling: str = "last",
    normalize: bool = True,
    seed: int = 0,
    matryoshka_dimensions: list[int] | None = None,
    default_prompt: str | None = None,
    with_lm_head: bool = False,
    max_seq_length: int | None = None,
    closing_eos: bool = False,
    do_lower_case: bool = False,
    **overrides,
) -> Path:
    """Create `path` as a sentence-transformers directory; returns the path. `pooling`: last,
    mean or cls. `matryoshka_dimensions` declares Matryoshka support in config.json (as vLLM reads
    it); `default_prompt` becomes the default prompt that sentence-transformers puts before inputs;
    `with_lm_head` saves the causal LM (head included), which can then generate too;
    `max_seq_length` (default: the position limit) and `do_lower_case` go to `sentence_bert_config.json`;
    `closing_eos`: the tokenizer ends every text with its EOS token, as Qwen3-Embedding's does."""
    from transformers import AutoModel, AutoModelForCausalLM

    if pooling not in POOLING_MODES:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {sorted(POOLING_MODES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    if matryoshka_dimensions:
        config.matryoshka_dimensions = sorted(matryoshka_dimensions)
        config.is_matryoshka = True
    torch.manual_seed(seed)
    model = (AutoModelForCausalLM if with_lm_head else AutoModel).from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer = build_tokenizer(config.vocab_size)
    if closing_eos:
        from tokenizers.processors import TemplateProcessing

        eos = (tokenizer.eos_token, tokenizer.eos_token_id)
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"$A {eos[0]}", special_tokens=[eos])
    tokenizer.save_pretrained(path)
    write_sentence_transformers_files(
        path,
        config.hidden_size,
        pooling,
        normalize,
        default_prompt,
        max_seq_length or config.max_position_embeddings,
        do_lower_case,
    )
    meta = {
        "note": "tiny random-weight embedding model written by engine.testing.tiny_embedding",
        "arch": arch,
        "pooling": pooling,
        "seed": seed,
    }
    (path / "pagedbatch_tiny.json").write_text(json.dumps(meta))
    return path


def write_sentence_transformers_files(
    path: Path,
    hidden_size: int,
    pooling: str,
    normalize: bool,
    default_prompt: str | None,
    max_seq_length: int,
    do_lower_case: bool = False,
    dense: list[dict] | None = None,
) -> None:
    """sentence-transformers' files beside a saved base model: `modules.json`, the Pooling config,
    Dense layers (`dense`: their configs, with a "weight" and "bias" tensor each), an optional
    Normalize, `config_sentence_transformers.json`, `sentence_bert_config.json`."""
    from safetensors.torch import save_file

    if pooling not in POOLING_MODES:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {sorted(POOLING_MODES)}")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    for layer in dense or []:
        idx = len(modules)
        folder = path / f"{idx}_Dense"
        folder.mkdir(exist_ok=True)
        config = {k: layer[k] for k in ("in_features", "out_features", "bias", "activation_function")}
        (folder / "config.json").write_text(json.dumps(config))
        tensors = {"linear.weight": layer["weight"].contiguous()}
        if layer["bias"]:
            tensors["linear.bias"] = layer["bias_tensor"].contiguous()
        save_file(tensors, str(folder / "model.safetensors"))
        modules.append(
            {"idx": idx, "name": str(idx), "path": folder.name, "type": "sentence_transformers.models.Dense"}
        )
    if normalize:
        idx = len(modules)
        modules.append(
            {"idx": idx, "name": str(idx), "path": f"{idx}_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (path / f"{idx}_Normalize").mkdir(exist_ok=True)
        (path / f"{idx}_Normalize" / "config.json").write_text("{}")
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    flags = {flag: flag == POOLING_MODES[pooling] for flag in POOLING_MODES.values()}
    pooling_config = {
        "word_embedding_dimension": hidden_size,
        **flags,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "include_prompt": True,
    }
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    prompts = {"query": default_prompt} if default_prompt else {}
    st_config = {
        "prompts": prompts,
        "default_prompt_name": "query" if default_prompt else None,
        "similarity_fn_name": "cosine",
    }
    (path / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": do_lower_case})
    )
