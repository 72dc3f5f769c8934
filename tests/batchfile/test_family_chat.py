"""Each family's chat template renders through the OpenAI chat path (`batchfile`'s parser) exactly as
transformers' `apply_chat_template` does, with the family's markers as single special tokens."""

from __future__ import annotations

import io
import json

import pytest
from transformers import AutoTokenizer

from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from engine.testing.tiny import ARCHITECTURES
from engine.testing.tiny_deepseek import USER

MARKERS = {"gemma2": "<start_of_turn>", "gemma3": "<start_of_turn>", "gemma3-mm": "<start_of_turn>", "phi3": "<|user|>"}
MARKERS.update({"gpt_oss": "<|start|>", "gpt_oss-mxfp4": "<|start|>", "deepseek_v2": USER, "deepseek_v3": USER})
# Mixtral's [INST] markup is plain text, not special tokens: tests/engine/test_moe.py checks its template
FAMILIES = [a for a in ARCHITECTURES if a not in ("llama", "mistral", "qwen2", "qwen3", "mixtral")]


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_chat_renders_as_transformers(tiny_model, arch):
    limits = ModelLimits.from_dir(tiny_model(arch), name="m")
    tok = AutoTokenizer.from_pretrained(tiny_model(arch))  # transformers' own, to compare with
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, world!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Paged attention?"},
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 3}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    (req,) = parse_requests(io.BytesIO(json.dumps(line).encode() + b"\n"), {"m": limits})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert req.prompt_token_ids == tok(text, add_special_tokens=False).input_ids
    marker = MARKERS.get(arch, "<|im_start|>")
    assert text.count(marker) >= 2 and tok.convert_tokens_to_ids(marker) in req.prompt_token_ids
    if marker == "<start_of_turn>":  # Gemma's template folds the system message into the first user turn
        assert "<start_of_turn>system" not in text and "<start_of_turn>user\nBe brief.\n\nHello" in text
