"""The tiny DeepSeek configs `engine.testing.tiny` writes: latent attention with its own sizes (a
query LoRA in V3, none in V2, as in DeepSeek-V2-Lite), one dense layer before two expert layers,
eight experts in four groups, a shared expert, and YaRN with DeepSeek's mscale (V3)."""

from __future__ import annotations

DEEPSEEK_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")

_COMMON = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
)


def deepseek_config_kwargs(arch: str) -> dict:
    if arch == "deepseek_v2":
        return dict(_COMMON, q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    if arch == "deepseek_v3":
        return dict(
            _COMMON,
            q_lora_rank=24,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        )
    raise ValueError(f"unknown DeepSeek architecture {arch!r}")


def deepseek_config_class(arch: str):
    import transformers

    return {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config}[arch]


def randomize_router_bias(model, seed: int) -> None:
    """V3's score-correction bias is zero at initialisation; random here, so that tests see it steer
    the choice (of the same order as the sigmoid scores' spread)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)


# DeepSeek-V3's chat markup (shortened from the hub template): a system prompt first, then
# <｜User｜>/<｜Assistant｜> turns, each answer closed by the end-of-sentence token.
BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% else %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)
# arch: (template, its special tokens, end of turn, bos), as engine.testing.tiny.FAMILY_CHAT holds them
DEEPSEEK_CHAT = {arch: (DEEPSEEK_TEMPLATE, [BOS, EOS, USER, ASSISTANT], EOS, BOS) for arch in DEEPSEEK_ARCHITECTURES}
