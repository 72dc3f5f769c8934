"""Load safetensors checkpoints (single file or sharded) into our model modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.llama import LlamaForCausalLM

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Multimodal checkpoints (Gemma 3, Mistral 3): the language model's weights under our names (transformers
# 5 and 4 layouts); the vision tower and projector are not loaded.
RENAMED_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
SKIPPED_PREFIXES = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.visual.",  # Qwen2.5-VL's vision transformer
    "visual.",
)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights found in {path}")
    return files


def load_weights(model: LlamaForCausalLM, path: Path, lm_head_optional: bool = False) -> bool:
    """Fill `model` from the checkpoint. A base model's weights (no `model.` prefix, as
    sentence-transformers saves them) load too; with `lm_head_optional` a checkpoint without an
    LM head is accepted. Returns whether the model has a real LM head."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # a tensor-parallel rank reads only its slice (engine.parallel.sharding.ShardReader)
    read = getattr(model, "read_checkpoint_tensor", None) or (lambda f, tensor_name, _name: f.get_tensor(tensor_name))
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                if name.endswith(IGNORED_SUFFIXES) or name.startswith(SKIPPED_PREFIXES):
                    continue
                if hasattr(model, "skips_checkpoint_weight") and model.skips_checkpoint_weight(name):
                    continue  # (DeepSeek-V3's multi-token-prediction layer)
                tensor_name = name
                name = _renamed(name)
                if not name.startswith(("model.", "lm_head.")):
                    name = f"model.{name}"
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue
                quant = getattr(model, "quant_loader", None)  # engine.quant: quantized layers' tensors
                if quant is not None and quant.take(name, lambda key=tensor_name: f.get_tensor(key)):
                    continue
                take = getattr(model, "take_checkpoint_tensor", None)  # layouts the model converts itself
                covered = take(name, lambda key=tensor_name, n=name: read(f, key, n)) if take else None
                if covered is not None:
                    loaded.update(covered)
                    continue
                slot = model.checkpoint_slot(name, params) if hasattr(model, "checkpoint_slot") else None
                if slot is not None:  # a layout the model places itself (mixture-of-experts weights)
                    with torch.no_grad():
                        _copy(slot[0], read(f, tensor_name, name), name)
                    loaded.update(slot[1])
                    continue
                target, shard = _target(name, model)
                if target not in params:
                    raise ValueError(f"checkpoint weight {name!r} has no place in the model")
                param = params[target]
                tensor = read(f, tensor_name, name)
                if hasattr(model, "checkpoint_tensor"):
                    tensor = model.checkpoint_tensor(target, tensor)
                with torch.no_grad():
                    if shard is None:
                        _copy(param, tensor, name)
                    else:
                        packed_name, index = shard
                        sizes = model.shard_sizes(packed_name)
                        start = sum(sizes[:index])
                        _copy(param.narrow(0, start, sizes[index]), tensor, name)
                loaded.add(target if shard is None else f"{target}#{shard[1]}")
    has_head = model.cfg.tie_word_embeddings or "lm_head.weight" in loaded
    if lm_head_optional and not has_head:
        loaded.add("lm_head.weight")
    _check_complete(model, params, loaded)
    if getattr(model, "quant_loader", None) is not None:
        model.quant_loader.check_complete()
    return has_head


def _renamed(name: str) -> str:
    for old, new in RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _target(name: str, model: LlamaForCausalLM) -> tuple[str, tuple[str, int] | None]:
    for part, (packed_name, index) in model.packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed_name}."), (packed_name, index)
    return name, None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def _check_complete(model, params, loaded) -> None:
    missing = []
    for name in params:
        if (name == "lm_head.weight" and model.cfg.tie_word_embeddings) or name in loaded:
            continue  # (a fused weight the checkpoint holds whole, as Phi-3's qkv_proj)
        keys = model.expected_keys(name) if hasattr(model, "expected_keys") else None
        if keys is not None:
            missing += [k for k in keys if k not in loaded]
            continue
        packed = next((p for p in ("qkv_proj", "gate_up_proj") if f".{p}." in name), None)
        if packed:
            count = len(model.shard_sizes(packed))
            missing += [f"{name}#{i}" for i in range(count) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
