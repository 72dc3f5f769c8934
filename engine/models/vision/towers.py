"""Vision encoders of the image-text families: transformers' own tower modules (CLIP, SigLIP, the
Qwen2.5-VL vision transformer, whose window attention runs batched: `engine.models.vision.attention`)
with the families' projectors (ours, in `projectors`), loaded from the wrapper checkpoint's
`vision_tower.*` / `multi_modal_projector.*` (or Qwen2.5-VL's `visual.*`) weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.vision.attention import batch_windows
from engine.models.vision.grid_index import precomputed
from engine.models.vision.projectors import Gemma3Projector, LlavaProjector

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.visual.", "visual.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def _hf_config(sub: dict):
    from transformers import CONFIG_MAPPING

    sub = dict(sub)
    return CONFIG_MAPPING[sub.pop("model_type")](**sub)


class VisionEncoder(nn.Module):
    """pixels of one or more same-shaped images -> their embeddings in the language model's space."""

    def __init__(self, family: str, raw: dict):
        super().__init__()
        from transformers import AutoModel

        self.family = family
        self.raw = raw
        text_hidden = raw["text_config"]["hidden_size"]
        vision = raw["vision_config"]
        if family == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

            cfg = _hf_config({**vision, "model_type": "qwen2_5_vl_vision"} if "model_type" not in vision else vision)
            self.tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg)
            batch_windows(self.tower)
            self.projector = None  # the merger is part of the tower
            return
        self.tower = AutoModel.from_config(_hf_config(vision))
        if family == "llava":
            layer = raw.get("vision_feature_layer", -2)
            self.layers = [layer] if isinstance(layer, int) else list(layer)
            self.strategy = raw.get("vision_feature_select_strategy", "default")
            self.projector = LlavaProjector(
                vision["hidden_size"] * len(self.layers),
                text_hidden,
                raw.get("projector_hidden_act", "gelu"),
                raw.get("multimodal_projector_bias", True),
            )
        else:
            self.projector = Gemma3Projector(
                vision, text_hidden, raw.get("mm_tokens_per_image", 256), raw["text_config"].get("rms_norm_eps", 1e-6)
            )

    def forward(self, pixels: dict) -> list[torch.Tensor]:
        """Embeddings per image ([tokens, text hidden] each) for a batch of preprocessed images."""
        pixel_values = pixels["pixel_values"]
        if self.family == "qwen2_5_vl":
            grid = pixels["image_grid_thw"]
            tower = self.tower
            indices = precomputed(grid, tower.spatial_merge_size, tower.window_size, tower.patch_size)
            out = tower(pixel_values, grid_thw=grid, **indices)
            merged = out.pooler_output if hasattr(out, "pooler_output") else out
            sizes = (grid.prod(-1) // self.tower.spatial_merge_size**2).tolist()
            return list(torch.split(merged, sizes))
        if self.family == "llava":
            out = self.tower(pixel_values, output_hidden_states=True, return_dict=True)
            selected = [out.hidden_states[i] for i in self.layers]
            if self.strategy == "default":
                selected = [h[:, 1:] for h in selected]
            return list(self.projector(torch.cat(selected, dim=-1)))
        out = self.tower(pixel_values, return_dict=True).last_hidden_state
        return list(self.projector(out))

    def load(self, path: Path, files: list[Path]) -> None:
        """Fill the tower and projector from the checkpoint; every weight of theirs must be there."""
        tower, projector = {}, {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                    for prefix in TOWER_PREFIXES:
                        if name.startswith(prefix):
                            tower[name[len(prefix) :]] = f.get_tensor(name)
                    for prefix in PROJECTOR_PREFIXES:
                        if name.startswith(prefix):
                            projector[name[len(prefix) :]] = f.get_tensor(name)
        _load_strict(self.tower, tower, "vision tower")
        if self.projector is not None:
            _load_strict(self.projector, projector, "multimodal projector")


def _load_strict(module: nn.Module, weights: dict, what: str) -> None:
    missing, unexpected = module.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.endswith(("position_ids", "inv_freq"))]
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's {what} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
