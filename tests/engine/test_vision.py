"""Image-text models (engine/multimodal, engine/models/vision_*) against transformers' greedy float32
generate, token for token, on tiny random configs: one image, two images of different sizes in one
prompt, a text-only prompt, the same text with another image after the first was cached (no KV shared),
chunked prefill with a budget of 32 (chunks cut through images), preemption in a tiny KV pool, LLM.chat
with data URLs, limit_mm_per_prompt."""

from __future__ import annotations

import sys

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import assert_pool_free
from tests.vision_helpers import IMAGE_MARKERS, chat_text, data_url, next_token_logprobs, picture, reference

FAMILIES = ["llava", "gemma3-vl", "qwen2.5-vl"]
TOKENS = 10


def prompt(arch: str, images: int, words: str = "Hello, world! How are you today?") -> str:
    marker = IMAGE_MARKERS[arch]
    body = " ".join([marker] * images) + words if images else words
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def cases(arch: str):
    """(text, images) pairs: one image, two of different sizes, text only, another image with the same
    text, and a prompt ending in its image (where Gemma 3's bidirectional image attention shows in the
    next token's logits)."""
    return [
        (prompt(arch, 1), [picture(1)]),
        (prompt(arch, 2, " Paged attention stores the key value cache."), [picture(2, 48, 30), picture(3, 20, 36)]),
        (prompt(arch, 0), []),
        (prompt(arch, 1), [picture(4)]),
        ("Hello, world! How are you today?" + IMAGE_MARKERS[arch], [picture(9, 36, 36)]),  # the image last
    ]


def run(llm, requests):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in requests]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize(
    "engine_args",
    [
        {},  # whole prompts
        {"max_num_batched_tokens": 32},  # chunked prefill: chunks start and end inside images
        {"num_kv_blocks": 9, "block_size": 8, "max_num_batched_tokens": 32},  # preemption in a tiny pool
    ],
    ids=["whole", "chunked32", "preempted"],
)
def test_greedy_matches_transformers(tiny_model, arch, engine_args):
    path = tiny_model(arch)
    llm = LLM(str(path), **engine_args)
    requests = cases(arch)
    expected = [reference(path, text, images, TOKENS) for text, images in requests]
    assert run(llm, requests) == expected  # all at once, batched
    if "num_kv_blocks" in engine_args:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_pool_free(llm.llm_engine)


def test_qwen_heads_of_64_match_transformers(tiny_model):
    """Heads of 64 (real models' size; the native CPU attention kernels take it, not the tiny model's 16) and
    M-RoPE sections scaled to them, chunked through the images."""
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    path = tiny_model("qwen2.5-vl", **shape)
    llm = LLM(str(path), max_num_batched_tokens=32)
    assert llm.llm_engine.runner.model_config.head_dim == 64
    requests = cases("qwen2.5-vl")
    assert run(llm, requests) == [reference(path, text, images, TOKENS) for text, images in requests]
    assert_pool_free(llm.llm_engine)


@pytest.mark.parametrize("arch", FAMILIES)
def test_same_text_other_image_shares_no_kv(tiny_model, arch):
    """The first image's KV is cached; the same text with a different image must not reuse it, while
    the same text with the same image does (and needs no encoder run)."""
    path = tiny_model(arch)
    llm = LLM(str(path), block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)

    def one(text, images):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference(path, text, images, TOKENS)
        return out.num_cached_tokens

    first, second = (prompt(arch, 1), [picture(5)]), (prompt(arch, 1), [picture(6)])
    assert one(*first) == 0
    assert one(*second) == 0  # same text and image size, other pixels: nothing shared
    assert one(*first) > 0  # the same image again: its prefix is served from the cache
    assert llm.llm_engine.runner.images.images_encoded == 2


@pytest.mark.parametrize("arch", FAMILIES)
def test_chat_with_data_urls(tiny_model, arch):
    path = tiny_model(arch)
    llm = LLM(str(path), max_num_batched_tokens=32)
    images = [picture(7, 50, 40), picture(8, 30, 30)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": data_url(images[0])}},
                {"type": "text", "text": " and "},
                {"type": "image_url", "image_url": {"url": data_url(images[1]), "detail": "low"}},
                {"type": "text", "text": " How are you?"},
            ],
        }
    ]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    expected = reference(path, chat_text(path, messages), images, TOKENS, add_special_tokens=False)
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("arch", FAMILIES)
def test_too_many_images_refused(tiny_model, arch):
    llm = LLM(str(tiny_model(arch)), limit_mm_per_prompt={"image": 1})
    request = {"prompt": prompt(arch, 2), "multi_modal_data": {"image": [picture(1), picture(2)]}}
    with pytest.raises(ValueError, match="at most 1 are allowed per prompt"):
        llm.generate(request, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="2 image placeholders .* but 1 images"):
        llm.generate(
            {**request, "multi_modal_data": {"image": picture(1)}}, SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("budget", [8192, 32])
def test_next_token_logprobs_match_transformers(tiny_model, arch, budget):
    """Logprobs, not only the argmax: a prompt ending in its image, where Gemma 3's bidirectional image
    attention moves the next token's logprobs by about 1e-2 (causal-only attention fails this)."""
    path = tiny_model(arch)
    text, images = cases(arch)[-1]
    expected = next_token_logprobs(path, text, images)
    llm = LLM(str(path), max_num_batched_tokens=budget)
    out = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": images}},
        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )[0]
    ours = out.outputs[0].logprobs[0]
    for token, entry in ours.items():
        assert abs(entry.logprob - expected[token].item()) < 1e-4, (token, entry.logprob, expected[token].item())


@pytest.mark.parametrize("arch", FAMILIES)
def test_repeated_image_encoded_once(tiny_model, arch):
    """One picture in several prompts of different text (no shared prefix): the encoder runs once."""
    path = tiny_model(arch)
    llm = LLM(str(path))
    shared = picture(30)
    requests = [
        (prompt(arch, 1, f" question {i}: how are you?").replace("user\n", f"user\n{i} "), [shared]) for i in range(3)
    ]
    assert run(llm, requests) == [reference(path, text, images, TOKENS) for text, images in requests]
    images = llm.llm_engine.runner.images
    assert images.images_encoded == 1 and images.encoder_calls == 1


def test_text_model_refuses_images(tiny_model):
    llm = LLM(str(tiny_model("qwen3")))
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": picture(1)}}, use_tqdm=False)


def test_qwen_dynamic_resolution(tiny_model):
    """Qwen2.5-VL's processor resizes each image between min_pixels and max_pixels to whole merged
    patches: one over max_pixels (scaled down), one under min_pixels (scaled up), one tall; the
    prompt's M-RoPE positions lay out each grid and decode continues at the prompt's delta."""
    arch = "qwen2.5-vl"
    path = tiny_model(arch)
    llm = LLM(str(path), max_num_batched_tokens=32)
    requests = [
        (prompt(arch, 1), [picture(40, 90, 70)]),
        (prompt(arch, 2, " small and tall"), [picture(41, 9, 11), picture(42, 16, 60)]),
    ]
    assert run(llm, requests) == [reference(path, text, images, TOKENS) for text, images in requests]
    processor = llm.llm_engine._image_prompts
    grids = [item.grid for item in processor.preprocess([picture(40, 90, 70)])]
    assert grids[0][1] * grids[0][2] * 16 <= 48 * 48  # within max_pixels (4-pixel patches)


def test_qwen_pixels_made_per_step_equal_the_processors(tiny_model):
    """Qwen2.5-VL's placeholder count comes from the image's size (the processor's resize rule) and its pixels
    from one processor call for a step's new images: the same grids and pixel values as the processor gives
    each image alone, at sizes that round up, round down, pass max_pixels and fall under min_pixels."""
    from engine.multimodal.engine_requests import prompt_processor
    from engine.multimodal.processor import fill_pixels

    llm = LLM(str(tiny_model("qwen2.5-vl")), device="cpu", dtype="float32")
    processor = prompt_processor(llm.llm_engine)
    sizes = [(90, 70), (9, 11), (16, 60), (33, 33), (200, 31), (8, 8)]
    images = [picture(50 + i, w, h) for i, (w, h) in enumerate(sizes)]
    items = processor.preprocess(images + images[:2])  # the first two twice: one processing each
    assert all(item.pixels is None for item in items)
    fill_pixels(items)
    for item, image in zip(items, images + images[:2]):
        alone = processor.image_processor(images=[image], return_tensors="pt")
        assert item.grid == tuple(alone["image_grid_thw"][0].tolist())
        assert item.length == alone["image_grid_thw"][0].prod().item() // processor.image_processor.merge_size**2
        assert torch.equal(item.pixels["pixel_values"], alone["pixel_values"])
        assert torch.equal(item.pixels["image_grid_thw"], alone["image_grid_thw"])
    assert processor.preprocess(images[:1])[0].pixels is items[0].pixels  # kept by hash for the next prompt


def test_qwen_flat_checkpoint_config(tmp_path):
    """A transformers 4 Qwen2.5-VL config.json (text settings at the top, `rope_scaling` of type mrope)
    reads as the Qwen2 decoder with M-RoPE sections."""
    from engine.hf.config import ModelConfig

    raw = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "use_sliding_window": False,
        "sliding_window": 32768,
        "vision_config": {"depth": 2, "hidden_size": 32, "out_hidden_size": 64},
    }
    cfg = ModelConfig.from_dict(raw, tmp_path)
    assert (cfg.architecture, cfg.mrope_section, cfg.rope_scaling, cfg.qkv_bias) == ("qwen2", (2, 3, 3), None, True)
    assert cfg.rope_theta == 1000000.0 and cfg.layer_windows == () and cfg.multimodal is raw


def test_each_prompt_prepared_once(tiny_model, monkeypatch):
    """`LLM.generate` checks every prompt before it adds any, and adds what it checked: each prompt's
    images go through the image processor once, not once to check and again to add."""
    from engine.multimodal.processor import ImagePromptProcessor

    arch = "qwen2.5-vl"
    path = tiny_model(arch)
    llm = LLM(str(path))
    calls = []
    preprocess = ImagePromptProcessor.preprocess
    monkeypatch.setattr(
        ImagePromptProcessor, "preprocess", lambda self, images: calls.append(1) or preprocess(self, images)
    )
    requests = [(prompt(arch, 1, f" question {i}"), [picture(50 + i)]) for i in range(3)]
    assert run(llm, requests) == [reference(path, text, images, TOKENS) for text, images in requests]
    assert len(calls) == 3


@pytest.mark.parametrize("arch", FAMILIES)
def test_markers_expanded_in_tokens_as_in_text(tiny_model, arch):
    """Where an image's run is its marker's token repeated, the prompt is tokenized with one marker per image
    and the runs put in as ids: the same ids as tokenizing the expanded text (what transformers' processor
    does), with the marker beside words, spaces, newlines and another marker; a count that does not match
    the images is refused as before."""
    from engine.multimodal.engine_requests import prompt_processor
    from engine.multimodal.images import ImageError

    llm = LLM(str(tiny_model(arch)), device="cpu", dtype="float32")
    engine = llm.llm_engine
    processor, tokenizer = prompt_processor(engine), engine.tokenizer
    marker = IMAGE_MARKERS[arch]
    items = processor.preprocess([picture(2, 48, 30), picture(3, 20, 36)])
    texts = [
        f"<|im_start|>user\n{marker}{marker}What is this?<|im_end|>\n",
        f"Look: {marker} and then {marker}\n\n end",
        f"{marker}\n{marker} ",
        f"no space{marker}after{marker}",
    ]
    for text in texts:
        for special in (True, False):
            want = tokenizer(processor.expand(text, items), add_special_tokens=special).input_ids
            assert processor.tokenize(tokenizer, text, items, special) == want, text
    assert processor.tokenize(tokenizer, texts[0], items, False).count(processor.image_token_id) == sum(
        item.length for item in items
    )
    with pytest.raises(ImageError, match="placeholders"):
        processor.tokenize(tokenizer, f"only one {marker}", items, False)


def test_preprocess_from_many_threads(tiny_model, monkeypatch):
    """A worker's shard threads prepare image requests at once: the processor's cache of recent images stays
    within its bound and no thread trips over another's eviction."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.multimodal import processor as processor_module
    from engine.multimodal.engine_requests import prompt_processor

    monkeypatch.setattr(processor_module, "RECENT_IMAGES", 2)
    llm = LLM(str(tiny_model("qwen2.5-vl")), device="cpu", dtype="float32")
    processor = prompt_processor(llm.llm_engine)
    pictures = [picture(seed, 24 + seed % 3 * 8, 24) for seed in range(48)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes: races show
    try:
        with ThreadPoolExecutor(6) as pool:
            lengths = list(pool.map(lambda image: processor.preprocess([image])[0].length, pictures * 3))
    finally:
        sys.setswitchinterval(switch)
    assert lengths == [processor.preprocess([image])[0].length for image in pictures] * 3
    assert len(processor._recent) <= 2
