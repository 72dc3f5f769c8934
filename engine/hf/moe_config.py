"""What a mixture-of-experts `config.json` says about its experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss), read without torch. `ModelConfig.moe` holds it; dense models have none."""

from __future__ import annotations

from dataclasses import dataclass

# Hugging Face architecture -> our family name (merged into SUPPORTED_ARCHITECTURES).
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routers: scores by softmax (V2) or sigmoid (V3, with a learned bias added for the
    choice only), the experts chosen within the `topk_group` best of `n_group` groups (None: no groups)."""

    scoring: str  # softmax | sigmoid
    n_group: int | None
    topk_group: int | None
    score_bias: bool  # e_score_correction_bias


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the chosen k probabilities to sum to one
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]  # the layers whose MLP is the expert block (the others are dense)
    routing: GroupedRouting | None = None  # None: softmax over every expert, the top k
    routed_scaling_factor: float = 1.0  # the chosen experts' weights times this (DeepSeek)
    # gpt-oss: a router with a bias whose softmax runs over the chosen k logits only; experts with
    # biases and the clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g <= limit, |up| <= limit
    gpt_oss: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def moe_settings(raw: dict, arch: str, num_layers: int) -> MoEConfig | None:
    """The expert settings of a MoE family's config; None for a dense family."""
    if arch not in MOE_ARCHITECTURES.values():
        return None
    num_experts = (
        raw.get("num_local_experts")
        if arch in ("mixtral", "gpt_oss")
        else (raw.get("num_experts") or raw.get("num_local_experts"))
    )
    top_k = raw.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"a {arch} config needs a positive number of experts, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k!r}")
    if arch == "gpt_oss":
        return MoEConfig(
            num_experts,
            top_k,
            raw["intermediate_size"],
            True,
            0,
            frozenset(range(num_layers)),
            gpt_oss=True,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )
    if arch == "mixtral":
        return MoEConfig(num_experts, top_k, raw["intermediate_size"], True, 0, frozenset(range(num_layers)))
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = raw.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    return MoEConfig(
        num_experts, top_k, raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False)), shared or 0, sparse
    )
