"""Write tiny random-weight model directories for tests, examples and benchmarks.

Nothing is downloaded: the config comes from `transformers`, the weights are random,
and a small byte-level BPE tokenizer with a chat template is trained on the fly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine import tiny_moe

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", *tiny_moe.MOE_ARCHITECTURES)

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


def build_tokenizer(vocab_size: int = 512, chat_template: str | None = None):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=chat_template or CHAT_TEMPLATE,
    )


def tiny_config(arch: str = "llama", **overrides):
    """A `transformers` config of the given architecture, small enough for CPU tests."""
    import transformers

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
    if arch in tiny_moe.MOE_ARCHITECTURES:
        kwargs.update(tiny_moe.moe_config_kwargs(arch))
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }.get(arch) or tiny_moe.moe_config_class(arch)
    return cls(**kwargs)


def write_tiny_model(path, arch: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """Create `path` holding config.json, safetensors weights and a tokenizer; returns the path.

    Keyword overrides go to the config (e.g. num_key_value_heads=1 for MQA,
    tie_word_embeddings=True, rope_scaling={...}).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    tokenizer = build_tokenizer(config.vocab_size, tiny_moe.chat_template(arch))
    tokenizer.save_pretrained(path)
    meta = {"note": "tiny random-weight model written by engine.tiny", "arch": arch, "seed": seed}
    (path / "pagedbatch_tiny.json").write_text(json.dumps(meta))
    return path
