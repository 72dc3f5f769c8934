"""Write tiny random-weight model directories for tests, examples and benchmarks.

Nothing is downloaded: the config comes from `transformers`, the weights are random,
and a small byte-level BPE tokenizer with a chat template is trained on the fly.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.testing import tiny_deepseek, tiny_moe, tiny_vision

ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "gemma3-mm",
    "phi3",
    "olmo2",
    "granite",
    "mistral3",
    *tiny_moe.MOE_ARCHITECTURES,
    *tiny_deepseek.DEEPSEEK_ARCHITECTURES,
    *tiny_vision.VISION_ARCHITECTURES,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "Continuous batching lets finished sequences leave and new ones join every step.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Large language models generate text one token at a time.",
    "Batch inference jobs are uploaded as JSONL files and results come back as Parquet.",
    "0123456789 + - * / = ( ) [ ] { } < > ; : ' \" , . ? !",
]


# Each family's own chat markup (shortened from the hub templates), so that chat tests render the
# family's shape: Gemma's turns (a system message folded into the first user turn), Phi-3's tags.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set sys = '' %}{% if messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}{% endif %}"
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (sys if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
FAMILY_CHAT = {  # arch: (template, its special tokens, end of turn, bos)
    "gemma2": (GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>", "<bos>"], "<end_of_turn>", "<bos>"),
    "phi3": (PHI3_TEMPLATE, ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "<|end|>", None),
}
FAMILY_CHAT["gemma3"] = FAMILY_CHAT["gemma3-mm"] = FAMILY_CHAT["gemma2"]
FAMILY_CHAT.update(tiny_vision.VISION_CHAT)
FAMILY_CHAT.update(tiny_deepseek.DEEPSEEK_CHAT)
FAMILY_CHAT.update(tiny_moe.MOE_CHAT)


def build_tokenizer(vocab_size: int = 512, arch: str = "llama"):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML-style special tokens (and the family's
    own chat markup for the families in FAMILY_CHAT)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    template, extra, eos, bos = FAMILY_CHAT.get(arch, (CHAT_TEMPLATE, [], "<|im_end|>", None))
    template = tiny_moe.chat_template(arch) or template
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + extra,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        bos_token=bos,
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=template,
    )


def tiny_config(arch: str = "llama", **overrides):
    """A `transformers` config of the given architecture, small enough for CPU tests."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {ARCHITECTURES}")
    kwargs = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=3,
        initializer_range=0.1,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(_FAMILY_DEFAULTS.get(arch, {}))
    if arch in tiny_moe.MOE_ARCHITECTURES:
        kwargs.update(tiny_moe.moe_config_kwargs(arch))
    if arch in tiny_deepseek.DEEPSEEK_ARCHITECTURES:
        kwargs.update(tiny_deepseek.deepseek_config_kwargs(arch))
    if arch in ("gemma3-mm", "mistral3"):
        return _multimodal_config(arch, kwargs, overrides)
    kwargs.update(overrides)
    return _config_class(arch)(**kwargs)


# Small settings that exercise each family's own parts: windows shorter than the test prompts,
# soft caps, local/global RoPE bases with linear scaling, partial rotary with LongRoPE, multipliers.
_GEMMA = dict(
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=12,
    tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh",
)
_FAMILY_DEFAULTS = {
    "mistral": dict(sliding_window=24),
    "gemma2": dict(
        _GEMMA,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=3,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": dict(
        _GEMMA,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=3,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    "phi3": dict(
        partial_rotary_factor=0.5,
        sliding_window=20,
        original_max_position_embeddings=512,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7],
            "long_factor": [2.0, 3.0, 4.0, 5.0],
        },
    ),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4, logits_scaling=4.0),
}
_FAMILY_DEFAULTS["gemma3-mm"] = _FAMILY_DEFAULTS["gemma3"]
_FAMILY_DEFAULTS["mistral3"] = _FAMILY_DEFAULTS["mistral"]


def _config_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "olmo2": transformers.Olmo2Config,
        "granite": transformers.GraniteConfig,
    }.get(arch) or (
        tiny_deepseek.deepseek_config_class(arch)
        if arch in tiny_deepseek.DEEPSEEK_ARCHITECTURES
        else tiny_moe.moe_config_class(arch)
    )


def _multimodal_config(arch: str, text: dict, overrides: dict):
    """A Gemma 3 or Mistral 3 image-text config around the tiny text model, with a tiny vision tower."""
    import transformers

    text = {**text, **overrides}
    if arch == "gemma3-mm":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        return transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text),
            vision_config=vision,
            mm_tokens_per_image=1,
            eos_token_id=text["eos_token_id"],
            tie_word_embeddings=text.get("tie_word_embeddings", True),
        )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=32,
        patch_size=8,
    )
    return transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**text),
        vision_config=vision,
        image_token_index=100_000,
        spatial_merge_size=2,  # past the vocabulary
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )


def write_tiny_model(path, arch: str = "llama", seed: int = 0, dtype=None, **overrides) -> Path:
    """Create `path` holding config.json, safetensors weights and a tokenizer; returns the path.

    Keyword overrides go to the config (e.g. num_key_value_heads=1 for MQA,
    tie_word_embeddings=True, rope_scaling={...}).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if arch in tiny_vision.VISION_ARCHITECTURES:
        text = tiny_config(tiny_vision.TEXT_ARCH[arch], **overrides)
        tokenizer = build_tokenizer(text.vocab_size, arch)
        return tiny_vision.write_tiny_vision_model(path, arch, text, tokenizer, seed, dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    dtype = dtype or torch.float32
    auto = AutoModelForImageTextToText if arch in ("gemma3-mm", "mistral3") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=dtype)
    tiny_deepseek.randomize_router_bias(model, seed)
    text = getattr(config, "text_config", config)
    model.generation_config.eos_token_id = getattr(config, "eos_token_id", None) or text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    model.save_pretrained(path)
    tokenizer = build_tokenizer(getattr(config, "text_config", config).vocab_size, arch)
    tokenizer.save_pretrained(path)
    if arch == "gpt_oss-mxfp4":
        tiny_moe.pack_experts_mxfp4(path)
    meta = {"note": "tiny random-weight model written by engine.testing.tiny", "arch": arch, "seed": seed}
    (path / "pagedbatch_tiny.json").write_text(json.dumps(meta))
    return path
