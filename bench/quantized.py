"""Generation tokens/s of FP8 (weight-only, per channel; FP8_DYNAMIC: the same weights with dynamic
per-token FP8 activations) and W4A16 (group 32) compressed-tensors checkpoints against the bf16 model
they were written from, in one run, plus each one's resident weight bytes. On the CPU the quantized
weights are dequantized per matmul (the memory saving is the point); on a GPU the Triton W8A16/W4A16
kernel multiplies them.

    python -m bench.quantized [--hidden 256] [--layers 4] [--prompts 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from engine import LLM, SamplingParams
from engine.quant.ct_writer import write_compressed_tensors
from engine.testing.tiny import write_tiny_model


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def prepare(path: Path, args):
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=args.prompts)
    llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )  # warm
    return llm


def timed(llm, args) -> float:
    """Generated tokens per second of one batch."""
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 4 for j in range(args.prompt_len)]} for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_model(
            Path(tmp) / "bf16",
            "llama",
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 3,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
        models = {"bf16": src}
        for scheme in ("FP8_WEIGHT", "FP8_DYNAMIC", "W4A16"):
            models[scheme] = write_compressed_tensors(src, Path(tmp) / scheme, scheme)
        llms = {name: prepare(path, args) for name, path in models.items()}
        best = dict.fromkeys(llms, 0.0)
        for _ in range(args.repeat):  # the models in turn, each repeat: a busy machine slows all of them alike
            for name, llm in llms.items():
                best[name] = max(best[name], timed(llm, args))
        results = {name: (best[name], llm.llm_engine.runner.weight_bytes) for name, llm in llms.items()}
    base_tps, base_bytes = results["bf16"]
    print(
        f"CPU: {cpu_name()}; llama hidden {args.hidden}, {args.layers} layers; {args.prompts} prompts x "
        f"{args.prompt_len} tokens, {args.max_tokens} generated; bfloat16 activations"
    )
    print("| model | tokens/s | vs bf16 | weights MiB | vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for name, (tps, nbytes) in results.items():
        print(f"| {name} | {tps:,.1f} | {tps / base_tps:.2f}x | {nbytes / 2**20:.1f} | {nbytes / base_bytes:.3f}x |")


if __name__ == "__main__":
    main()
