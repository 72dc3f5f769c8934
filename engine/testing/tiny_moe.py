"""The tiny mixture-of-experts configs `engine.testing.tiny` writes (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss, and gpt-oss with its experts packed as MXFP4 like the hub's), and the chat template of each
family: Mixtral's `[INST]` turns, gpt-oss's harmony turns (shortened); the Qwen families keep ChatML."""

from __future__ import annotations

import json
from pathlib import Path

MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "gpt_oss-mxfp4")

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


# gpt-oss's harmony format: a system message becomes the developer's instructions, the assistant answers
# on its final channel.
GPT_OSS_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|start|>developer<|message|># Instructions\n\n' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{% else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
GPT_OSS_TOKENS = ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"]
# arch: (template, its special tokens, end of turn, bos), as engine.testing.tiny's FAMILY_CHAT
MOE_CHAT = {arch: (GPT_OSS_CHAT_TEMPLATE, GPT_OSS_TOKENS, "<|return|>", None) for arch in ("gpt_oss", "gpt_oss-mxfp4")}


def moe_config_kwargs(arch: str) -> dict:
    """Expert settings of a tiny config: 8 experts, 2 per token; Qwen2-MoE with a shared expert
    and its last layer dense (`mlp_only_layers`), Qwen3-MoE with renormalised top-k."""
    if arch == "mixtral":
        return dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    if arch == "qwen2_moe":
        return dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=128,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        )
    if arch == "qwen3_moe":
        return dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=128,
            norm_topk_prob=True,
            head_dim=32,
        )
    if arch in ("gpt_oss", "gpt_oss-mxfp4"):  # a window shorter than the test prompts, clamping that bites
        return dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,  # a multiple of MXFP4's 32-weight groups
            head_dim=16,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=12,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 256,
                "rope_theta": 150000.0,
            },
        )
    raise ValueError(f"unknown mixture-of-experts architecture {arch!r}")


def moe_config_class(arch: str):
    import transformers

    return {
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
        "gpt_oss-mxfp4": transformers.GptOssConfig,
    }[arch]


def chat_template(arch: str) -> str | None:
    """The family's own template where it differs from the tiny default (ChatML)."""
    return MIXTRAL_CHAT_TEMPLATE if arch == "mixtral" else None


def pack_experts_mxfp4(path: Path) -> None:
    """Rewrite a saved gpt-oss as the hub ships it: each expert's gate_up_proj and down_proj
    (transformers' [E, in, out]) as MXFP4 `_blocks` and `_scales` over [E, out, in], and a
    `quantization_config` naming mxfp4."""
    from safetensors.torch import load_file, save_file

    from engine.quant.mxfp4 import pack_mxfp4

    weights = Path(path) / "model.safetensors"
    packed = {}
    for name, tensor in load_file(str(weights)).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = pack_mxfp4(tensor.transpose(1, 2).contiguous())
        else:
            packed[name] = tensor
    save_file(packed, str(weights), metadata={"format": "pt"})
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    config_file.write_text(json.dumps(config, indent=2))
