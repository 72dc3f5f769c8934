"""Image-chat lines per second: our engine against transformers' batched `generate`, side by side in
one run, on the same tiny random-weight image-text model and the same chats.

    python -m bench.vision [--arch llava|gemma3-vl|qwen2.5-vl] [--lines 48] [--batch 16] [--max-tokens 32]
                           [--threads N]

Each line is one user turn with one image (distinct pictures of a few sizes, every fourth one repeated, as
in a job with shared pictures) and a short question; greedy, EOS ignored, float32 on the CPU. Ours: one
`LLM.chat` over all lines (continuous batching, the encoder cache, prefix caching). transformers: the
model directory's own processor (PIL image processor) and model class, `generate` in batches of
`--batch` with left padding. Both are timed after a warm-up, `--repeats` times over new pictures of the
same sizes (the same sets for both), the best time counting; the table gives lines/s and the ratio.
The tiny model is the `pagedbatch tiny-model --arch` one (Qwen2.5-VL: its processor class needs
torchvision, so transformers gets the image processor's outputs and the expanded text). vLLM's CPU
build cannot serve a vision model here: its vision path imports torchvision, which has no build for
this CPU torch, so vLLM is not in the table.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def chats(count: int, first_seed: int = 0):
    from tests.vision_helpers import data_url, picture

    lines = []
    for i in range(count):
        seed = first_seed + (i // 4 * 4 if i % 4 == 3 else i)  # every fourth picture repeats an earlier one
        image = picture(seed, 24 + seed % 5 * 8, 24 + seed % 3 * 10)
        lines.append(
            (
                image,
                [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": data_url(image)}},
                            {"type": "text", "text": f"Question {i}: what is in this picture? Be brief."},
                        ],
                    }
                ],
            )
        )
    return lines


def run_ours(path: Path, line_sets, max_tokens: int, warm_lines) -> tuple[float, list]:
    from engine import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # warm-up on other pictures of the same sizes: the CPU kernels compile for the batch's shapes once
    llm.chat([conversation for _, conversation in warm_lines], params, use_tqdm=False)
    best, tokens = float("inf"), None
    for lines in line_sets:
        start = time.perf_counter()
        outs = llm.chat([conversation for _, conversation in lines], params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        tokens = tokens or [o.outputs[0].token_ids for o in outs]
    return best, tokens


def run_transformers(path: Path, line_sets, max_tokens: int, batch: int, warm_lines) -> tuple[float, list]:
    from transformers import AutoModelForImageTextToText

    from tests.vision_helpers import chat_text, model_inputs, reference_processor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = reference_processor(path, model.config)  # Qwen2.5-VL: image processor and tokenizer
    tokenizer = processor[1] if isinstance(processor, tuple) else processor.tokenizer
    tokenizer.padding_side = "left"

    def generate(chunk_images, chunk_texts):
        images = chunk_images if isinstance(processor, tuple) else [[image] for image in chunk_images]
        inputs = model_inputs(processor, chunk_texts, images, add_special_tokens=False, padding=True)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
        return out[:, inputs["input_ids"].shape[1] :].tolist()

    warm_texts = [chat_text(path, conversation) for _, conversation in warm_lines[:batch]]
    generate([image for image, _ in warm_lines[:batch]], warm_texts)  # warm-up
    best, first = float("inf"), None
    for lines in line_sets:
        texts = [chat_text(path, conversation) for _, conversation in lines]  # rendered before the clock starts
        start = time.perf_counter()
        tokens = []
        for i in range(0, len(lines), batch):
            tokens += generate([image for image, _ in lines[i : i + batch]], texts[i : i + batch])
        best = min(best, time.perf_counter() - start)
        first = first or tokens
    return best, first


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
        platform.processor(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llava", choices=["llava", "gemma3-vl", "qwen2.5-vl"])
    parser.add_argument("--lines", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each engine; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    parser.add_argument(
        "--text-hidden",
        type=int,
        default=0,
        help="the language model's hidden size, in heads of 64 (0: the tiny model's 64, heads of 16)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.testing.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        shape = {}
        if args.text_hidden:
            heads = args.text_hidden // 64
            shape = dict(
                hidden_size=args.text_hidden,
                num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2),
                head_dim=64,
                intermediate_size=2 * args.text_hidden,
            )
        path = write_tiny_model(Path(tmp) / args.arch, args.arch, **shape)
        line_sets = [chats(args.lines, first_seed=1_000 * r) for r in range(args.repeats)]
        warm_lines = chats(args.lines, first_seed=100_000)
        ours, our_tokens = run_ours(path, line_sets, args.max_tokens, warm_lines)
        theirs, their_tokens = run_transformers(path, line_sets, args.max_tokens, args.batch, warm_lines)
    same = sum(a == b for a, b in zip(our_tokens, their_tokens))
    print(
        f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}; tiny {args.arch}, {args.lines} image-chat "
        f"lines, {args.max_tokens} tokens each, greedy float32, best of {args.repeats}"
    )
    print("| engine | seconds | lines/s |")
    print("| --- | --- | --- |")
    print(f"| pagedbatch (LLM.chat) | {ours:.2f} | {args.lines / ours:.1f} |")
    print(f"| transformers generate (batch {args.batch}, left padded) | {theirs:.2f} | {args.lines / theirs:.1f} |")
    print(f"| ratio | | {theirs / ours:.2f}x |")
    print("| vLLM (CPU build) | n/a | cannot run: its vision path imports torchvision (no build for this torch) |")
    print(
        f"same tokens as transformers' batched generate: {same}/{args.lines} lines (left padding changes float "
        "rounding in transformers' batch; the exactness tests compare unpadded runs)"
    )


if __name__ == "__main__":
    main()
