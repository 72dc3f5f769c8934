"""Tiny random-weight image-text models (`pagedbatch tiny-model --arch llava`), each written with its
processor files as transformers saves them: processor_config.json, preprocessor_config.json (a PIL
image processor), the tokenizer with the family's image tokens, and a chat template that renders
{"type": "image"} content parts as the family's image marker."""

from __future__ import annotations

from pathlib import Path

VISION_ARCHITECTURES = ("llava", "gemma3-vl", "qwen2.5-vl")
TEXT_ARCH = {"llava": "llama", "gemma3-vl": "gemma3", "qwen2.5-vl": "qwen2"}  # the language model under each


def _chat_template(marker: str) -> str:
    return (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + marker + "' }}"
        "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


# arch: (chat template, extra special tokens, end of turn, bos), as engine.tiny.FAMILY_CHAT
VISION_CHAT = {
    "llava": (_chat_template("<image>"), ["<image>"], "<|im_end|>", None),
    "gemma3-vl": (
        _chat_template("<start_of_image>"),
        ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
        "<|im_end|>",
        None,
    ),
    "qwen2.5-vl": (
        _chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        "<|im_end|>",
        None,
    ),
}
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def write_tiny_vision_model(path, arch: str, text, tokenizer, seed: int = 0, dtype=None) -> Path:
    """`text`: the tiny language model's config; `tokenizer`: the tiny tokenizer with this arch's tokens
    (engine.testing.tiny.write_tiny_model passes both)."""
    import torch
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config, processor = {"llava": _llava, "gemma3-vl": _gemma3, "qwen2.5-vl": _qwen2_5_vl}[arch](text, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.float32)
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)
    if arch == "qwen2.5-vl":  # its processor class needs torchvision (video): the image processor and tokenizer
        tokenizer.save_pretrained(path)
    return path


def _llava(text, tokenizer):
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,
        projection_dim=32,
    )
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.eos_token_id = text.eos_token_id
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    return config, processor


def _gemma3(text, tokenizer):
    import transformers

    tokenizer._set_model_specific_special_tokens(special_tokens=GEMMA3_TOKENS)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=7
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        eos_token_id=text.eos_token_id,
        tie_word_embeddings=True,
    )
    images = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=tokenizer.chat_template
    )
    return config, processor


def _qwen2_5_vl(text, tokenizer):
    """A windowed vision transformer of 3 blocks (block 1 attends over the whole image), 4-pixel patches
    merged 2x2, windows of 2x2 merged patches; M-RoPE over 2 + 3 + 3 frequencies of 16-wide heads.
    The "processor" saved is the PIL image processor (min/max pixels); the tokenizer is saved beside it."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_CHAT["qwen2.5-vl"][1]}
    half = text.hidden_size // text.num_attention_heads // 2  # frequencies per head: [2, 3, 3] of 8 at head size 16
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text_config = transformers.Qwen2_5_VLTextConfig(
        **{k: getattr(text, k) for k in _TEXT_KEYS},
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=16,
        out_hidden_size=text.hidden_size,
        fullatt_block_indexes=[1],
        tokens_per_second=2,
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = text.eos_token_id
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
    return config, images


_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "initializer_range",
)
