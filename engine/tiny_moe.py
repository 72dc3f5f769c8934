"""The tiny mixture-of-experts configs `engine.tiny` writes (Mixtral, Qwen2-MoE, Qwen3-MoE), and
the chat template of each family: Mixtral's `[INST]` turns; the Qwen families keep ChatML."""

from __future__ import annotations

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")

# Mistral's instruct format: an optional system prompt joins the first user turn.
MIXTRAL_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{{ bos_token or '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('roles must alternate user/assistant after an optional system') }}"
    "{% endif %}{% endfor %}"
)


def moe_config_kwargs(arch: str) -> dict:
    """Expert settings of a tiny config: 8 experts, 2 per token; Qwen2-MoE with a shared expert
    and its last layer dense (`mlp_only_layers`), Qwen3-MoE with renormalised top-k."""
    if arch == "mixtral":
        return dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    if arch == "qwen2_moe":
        return dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                    shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1])
    if arch == "qwen3_moe":
        return dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                    norm_topk_prob=True, head_dim=32)
    raise ValueError(f"unknown mixture-of-experts architecture {arch!r}")


def moe_config_class(arch: str):
    import transformers

    return {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
            "qwen3_moe": transformers.Qwen3MoeConfig}[arch]


def chat_template(arch: str) -> str | None:
    """The family's own template where it differs from the tiny default (ChatML)."""
    return MIXTRAL_CHAT_TEMPLATE if arch == "mixtral" else None
