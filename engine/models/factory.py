"""The model class a config asks for: the dense Llama family, its mixture-of-experts variants (gpt-oss
among them), or DeepSeek's latent-attention models."""

from __future__ import annotations

from engine.hf.config import ModelConfig
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.moe_causal_lm import MoEForCausalLM
from engine.runner.ops import Ops


def build_model(cfg: ModelConfig, ops: Ops) -> LlamaForCausalLM:
    if cfg.mla is not None:
        return DeepseekForCausalLM(cfg, ops)
    if cfg.moe is None:
        return LlamaForCausalLM(cfg, ops)
    return GptOssForCausalLM(cfg, ops) if cfg.moe.gpt_oss else MoEForCausalLM(cfg, ops)
