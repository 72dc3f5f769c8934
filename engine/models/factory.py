"""The model class a config asks for: the dense Llama family, or its mixture-of-experts variants."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe_causal_lm import MoEForCausalLM
from engine.ops import Ops


def build_model(cfg: ModelConfig, ops: Ops) -> LlamaForCausalLM:
    return MoEForCausalLM(cfg, ops) if cfg.moe is not None else LlamaForCausalLM(cfg, ops)
