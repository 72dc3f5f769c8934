"""What the dense families beyond Llama (Gemma 2/3, Phi-3/4, OLMo 2, Granite, the text model of
Gemma 3 and Mistral 3 multimodal checkpoints) ask of the one shared decoder (`engine.models.llama`),
read from a Hugging Face config without torch: `ModelConfig` takes these settings as they are.
"""

from __future__ import annotations

import math

# HF activation names -> ours; anything else is refused.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
# Multimodal wrappers whose `text_config` describes the language model (its vision tower is skipped).
MULTIMODAL_WRAPPERS = (
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
# Wrappers over any text model: the text config's model_type names the language model's architecture.
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
SLIDING, FULL = "sliding_attention", "full_attention"


def text_config(raw: dict) -> dict:
    """The language model's config: `text_config` of a multimodal wrapper (with the wrapper's
    architectures, and its eos / tie settings where the text config lacks them), else `raw`."""
    archs = raw.get("architectures") or []
    inner = raw.get("text_config")
    if "Qwen2_5_VLForConditionalGeneration" in archs and not isinstance(inner, dict):
        inner = {k: v for k, v in raw.items() if k != "vision_config"}  # transformers 4's flat layout
    if not isinstance(inner, dict) or not any(a in MULTIMODAL_WRAPPERS for a in archs):
        return raw
    merged = {**inner, "architectures": archs}
    if "Qwen2_5_VLForConditionalGeneration" in archs:  # Qwen2 decoder; M-RoPE from its rope settings
        merged["architectures"] = ["Qwen2ForCausalLM"]
    if "LlavaForConditionalGeneration" in archs:
        text_arch = TEXT_ARCHITECTURES.get(inner.get("model_type", "llama"))
        if text_arch is None:
            raise ValueError(f"LLaVA over a {inner.get('model_type')!r} language model is not supported")
        merged["architectures"] = [text_arch]
    for key in ("eos_token_id", "tie_word_embeddings", "torch_dtype", "dtype"):
        if merged.get(key) is None and raw.get(key) is not None:
            merged[key] = raw[key]
    return merged


def activation(raw: dict) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def layer_types(raw: dict, arch: str) -> list[str]:
    """Per layer, sliding_attention or full_attention, as transformers decides them."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return [FULL] * n
    if raw.get("layer_types"):
        types = list(raw["layer_types"])
        if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"unsupported layer_types {types!r}")
        return types
    if arch in ("gemma2", "gpt_oss"):
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    if arch == "gemma3":
        pattern = raw.get("sliding_window_pattern", 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if arch == "qwen2":
        first = raw.get("max_window_layers", n)
        return [SLIDING if i >= first else FULL for i in range(n)]
    return [SLIDING] * n


def rope_parameters(raw: dict, layer_type: str = FULL) -> dict:
    """{"rope_theta", "rope_type", ...scaling} of one layer type, from transformers 4's `rope_theta` +
    `rope_scaling` (+ Gemma 3's `rope_local_base_freq`) or transformers 5's `rope_parameters` (nested
    by layer type or not). Scaling types need the context lengths: they are filled in here."""
    params = dict(raw.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:
        params = dict(params.get(layer_type) or params.get(FULL) or {})
        scaling = {}
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        if layer_type == SLIDING and raw.get("rope_local_base_freq") is not None:  # Gemma 3, transformers 4
            return {"rope_theta": raw["rope_local_base_freq"], "rope_type": "default"}
    merged = {**scaling, **params}
    merged["rope_theta"] = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = merged.pop("type", None) or merged.get("rope_type") or "default"
    if kind == "mrope":  # Qwen2.5-VL (transformers 4): default frequencies, three position axes
        kind = "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    merged["rope_type"] = kind
    if kind in ("yarn", "longrope", "llama3"):
        if kind == "longrope" and raw.get("original_max_position_embeddings"):  # Phi-3 keeps it outside
            merged["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        merged.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        merged.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
    return merged


def mrope_section(raw: dict) -> tuple | None:
    """Qwen2.5-VL's M-RoPE: how many rotary frequencies follow the temporal, height and width positions."""
    section = rope_parameters(raw).get("mrope_section")
    return tuple(section) if section else None


def rotary_dim(raw: dict, head_dim: int) -> int:
    factor = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    dim = int(head_dim * factor)
    if dim % 2 or dim <= 0:
        raise ValueError(f"partial_rotary_factor {factor} gives an odd rotary size {dim}")
    return dim


def family_settings(raw: dict, arch: str, head_dim: int) -> dict:
    """ModelConfig's family switches (see its fields) for `arch`'s config `raw`."""
    gemma = arch in ("gemma2", "gemma3")
    types = layer_types(raw, arch)
    window = raw.get("sliding_window")
    settings = dict(
        hidden_act=activation(raw),
        layer_windows=tuple(window if t == SLIDING else None for t in types),
        attn_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        rotary_dim=rotary_dim(raw, head_dim),
        attn_sinks=arch == "gpt_oss",
    )
    if not any(settings["layer_windows"]):
        settings["layer_windows"] = ()
    if gemma:
        settings.update(
            attn_scale=raw.get("query_pre_attn_scalar", head_dim) ** -0.5,
            embedding_scale=math.sqrt(raw["hidden_size"]),
            embedding_scale_in_dtype=True,
            norm_offset=1.0,
            norm_layout="sandwich",
        )
        if arch == "gemma3" and SLIDING in types:
            settings["local_rope"] = rope_parameters(raw, SLIDING)
    elif arch == "olmo2":
        settings.update(norm_layout="post", qk_norm_scope="all")
    elif arch == "granite":
        settings.update(
            attn_scale=raw.get("attention_multiplier", 1.0),
            embedding_scale=raw.get("embedding_multiplier", 1.0),
            residual_multiplier=raw.get("residual_multiplier", 1.0),
            logits_divisor=raw.get("logits_scaling", 1.0),
        )
    return settings
