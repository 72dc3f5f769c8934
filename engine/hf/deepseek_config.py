"""What a DeepSeek V2/V3 `config.json` says, read without torch: the multi-head latent attention's
sizes and the experts' grouped router, as `ModelConfig` fields (`deepseek_settings`).

The KV cache of a latent-attention model holds, per token and layer, one entry of
kv_lora_rank + qk_rope_head_dim values (the normed latent c_kv and the rotated shared key k_pe),
not per-head keys and values: the cache and the paged attention kernels see it as one KV head
(`num_kv_heads` 1) of that width (`head_dim`), read both as keys and as values
(`engine.models.mla`). Defaults are transformers' where a config leaves a key out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.hf.moe_config import GroupedRouting, MoEConfig

# Hugging Face architecture -> our family name (merged into SUPPORTED_ARCHITECTURES).
DEEPSEEK_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: queries from one projection (q_proj), as DeepSeek-V2-Lite
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary features come in pairs (x0, x1), (x2, x3), ...
    attention_bias: bool  # on q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def cache_width(self) -> int:
        """Values per token and layer in the KV cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict | None) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under YaRN (DeepSeek's
    scaling of the whole score, beside the attention factor folded into the rotary table)."""
    scale = qk_head_dim**-0.5
    if rope and rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def _routing(raw: dict, arch: str) -> GroupedRouting:
    if arch == "deepseek_v3":  # sigmoid scores, bias-corrected choice, groups ranked by their top two
        return GroupedRouting("sigmoid", raw.get("n_group", 8), raw.get("topk_group", 4), True)
    grouped = raw.get("topk_method", "greedy") == "group_limited_greedy"
    if not grouped and raw.get("topk_method", "greedy") != "greedy":
        raise ValueError(f"DeepSeek-V2 topk_method {raw['topk_method']!r} is not supported")
    return GroupedRouting(
        "softmax", raw.get("n_group") if grouped else None, raw.get("topk_group") if grouped else None, False
    )


def deepseek_settings(raw: dict, arch: str, rope: dict | None) -> dict:
    """ModelConfig fields of a DeepSeek config (over the Llama-family reading); {} for other families."""
    if arch not in DEEPSEEK_ARCHITECTURES.values():
        return {}
    v3 = arch == "deepseek_v3"
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank", 1536),
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=raw.get("qk_rope_head_dim", 64),
        v_head_dim=raw.get("v_head_dim", 128),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,  # V2 rotates complex pairs
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    layers = raw["num_hidden_layers"]
    num_experts = raw.get("n_routed_experts", 256 if v3 else 64)
    top_k = raw.get("num_experts_per_tok") or 8
    routing = _routing(raw, arch)
    if routing.n_group and (num_experts % routing.n_group or not 1 <= (routing.topk_group or 0) <= routing.n_group):
        raise ValueError(f"{num_experts} experts cannot form {routing.n_group} groups of which {routing.topk_group}")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=raw["moe_intermediate_size"],
        # transformers' V2 router never renormalises (nor did DeepSeek-V2's checkpoints ask it to)
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if v3 else False,
        shared_expert_intermediate_size=raw["moe_intermediate_size"] * raw.get("n_shared_experts", 1 if v3 else 2),
        sparse_layers=frozenset(range(raw.get("first_k_dense_replace", 3 if v3 else 0) or 0, layers)),
        routing=routing,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
    )
    return dict(
        num_kv_heads=1,
        head_dim=mla.cache_width,
        rotary_dim=mla.qk_rope_head_dim,
        attn_scale=softmax_scale(mla.qk_nope_head_dim + mla.qk_rope_head_dim, rope),
        qkv_bias=False,
        o_bias=mla.attention_bias,
        mla=mla,
        moe=moe,
    )
