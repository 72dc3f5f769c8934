"""Images and transformers references for the image-text tests (engine, batch files, REST)."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest
import torch

IMAGE_MARKERS = {
    "llava": "<image>",
    "gemma3-vl": "<start_of_image>",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
ALLOWED_HOST = "127.0.0.2"  # the image test server: allowed by PAGEDBATCH_IMAGE_FETCH_ALLOW; 127.0.0.1 is not
_models: dict = {}


def picture(seed: int, width: int = 40, height: int = 32):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_text(path, messages) -> str:
    """The conversation rendered by the model's chat template, with {"type": "image"} parts."""
    from transformers import AutoTokenizer

    hf = [
        {**m, "content": [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    return AutoTokenizer.from_pretrained(path).apply_chat_template(hf, tokenize=False, add_generation_prompt=True)


def reference(path, text: str, images: list, max_new_tokens: int, add_special_tokens: bool = True) -> list[int]:
    """transformers' greedy float32 generate through the directory's own processor (its PIL image
    processor) and model class."""
    from transformers import AutoModelForImageTextToText

    key = str(path)
    if key not in _models:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # our side runs with ignore_eos
        _models[key] = (reference_processor(path, model.config), model)
    processor, model = _models[key]
    inputs = model_inputs(processor, text, images, add_special_tokens)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def reference_processor(path, config):
    """The directory's processor; Qwen2.5-VL's class needs torchvision (its video half), so there it is
    the PIL image processor and the tokenizer, put together below as the processor does."""
    from transformers import AutoProcessor, AutoTokenizer, Qwen2VLImageProcessorPil

    if config.model_type != "qwen2_5_vl":
        return AutoProcessor.from_pretrained(path)
    return Qwen2VLImageProcessorPil.from_pretrained(path), AutoTokenizer.from_pretrained(path), config.image_token_id


def model_inputs(processor, text, images: list, add_special_tokens: bool = True, **kwargs) -> dict:
    """Model inputs of `text` (or a batch of texts; `kwargs` such as padding=True) with `images` in order."""
    if not isinstance(processor, tuple):
        return processor(
            images=images or None, text=text, return_tensors="pt", add_special_tokens=add_special_tokens, **kwargs
        )
    image_processor, tokenizer, image_token_id = processor
    texts, inputs = [text] if isinstance(text, str) else list(text), {}
    if images:
        inputs = dict(image_processor(images=images, return_tensors="pt"))
        grids, merge = iter(inputs["image_grid_thw"]), image_processor.merge_size**2
        for i, one in enumerate(texts):  # each image's pad token -> one per merged patch square
            for _ in range(one.count("<|image_pad|>")):
                one = one.replace("<|image_pad|>", "<|placeholder|>" * (int(next(grids).prod()) // merge), 1)
            texts[i] = one.replace("<|placeholder|>", "<|image_pad|>")
    ids = tokenizer(
        texts if not isinstance(text, str) else texts[0],
        return_tensors="pt",
        add_special_tokens=add_special_tokens,
        **kwargs,
    )
    inputs.update(ids)
    inputs["mm_token_type_ids"] = (ids["input_ids"] == image_token_id).int()
    return inputs


def next_token_logprobs(path, text: str, images: list) -> torch.Tensor:
    """transformers' log-probabilities of the token after the prompt (one forward, the processor's
    token_type_ids included: Gemma 3's bidirectional image attention)."""
    reference(path, text, images, 1)  # loads the model once
    processor, model = _models[str(path)]
    inputs = model_inputs(processor, text, images)
    with torch.no_grad():
        return torch.log_softmax(model(**inputs).logits[0, -1].float(), dim=-1)


@pytest.fixture
def image_server(tmp_path):
    """(base URL, port) of a local HTTP server at ALLOWED_HOST serving cat.png."""
    buffer = io.BytesIO()
    picture(21, 44, 33).save(buffer, format="PNG")
    (tmp_path / "cat.png").write_bytes(buffer.getvalue())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer((ALLOWED_HOST, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{ALLOWED_HOST}:{server.server_address[1]}", server.server_address[1]
    server.shutdown()
