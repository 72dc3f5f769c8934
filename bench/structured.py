"""Structured decoding throughput vs unconstrained decoding of the same batch, on CPU, in one run.

    python -m bench.structured [--requests 32] [--max-tokens 160] [--rounds 3] [--device cpu] [--finish-only]

First, per tiny model, how many JSON-schema outputs finish (`stop`) within the token budget of the compact
rendering of their schema's largest instance, and how many of those validate (compact whitespace, the default,
against vLLM's default of any whitespace).

Workload: the ~25M-parameter Qwen3-shaped model of `bench.engine_cpu` (random float32 weights);
`--requests` prompts of 16-128 tokens, each constrained by one of 8 JSON schemas (nested objects,
bounded arrays, enums, numbers; compact whitespace), sampled at temperature 1 with a seed. The unconstrained run then
generates exactly as many tokens per request (EOS ignored), so both runs do the same model work and
the ratio measures what the grammar costs: mask filling, applying and matcher updates. Grammars
are compiled once before timing (the cold compile time is printed apart). The two runs alternate
for `--rounds` rounds (which goes first alternates) and each keeps its fastest, so load from other
processes hits both alike; the target is >= 0.8x. The time spent in the grammar work itself (mask
filling and applying, matcher updates) is measured too and printed as a share of the structured run.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from bench.engine_cpu import BENCH_CONFIG


def schemas() -> list[dict]:
    out = []
    for i in range(8):
        out.append(
            {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 10 ** (3 + i % 4)},
                    "name": {"type": "string", "maxLength": 8 + 4 * i},
                    "status": {"enum": ["open", "closed", "pending", f"state{i}"]},
                    "scores": {
                        "type": "array",
                        "items": {"type": "number", "minimum": 0, "maximum": 100},
                        "minItems": 1,
                        "maxItems": 4 + i,
                    },
                    "owner": {
                        "type": "object",
                        "properties": {"login": {"type": "string", "maxLength": 12}, "admin": {"type": "boolean"}},
                        "required": ["login", "admin"],
                        "additionalProperties": False,
                    },
                    "labels": {"type": "array", "items": {"enum": ["bug", "docs", "perf", "ui"]}, "maxItems": 3},
                },
                "required": ["id", "name", "status", "scores", "owner"],
                "additionalProperties": False,
            }
        )
    return out


def largest_instance(schema: dict):
    """The longest value a schema allows (strings at maxLength, arrays at maxItems, the longest enum value,
    numbers at their widest spelling): what a compact rendering's token budget is measured on."""
    if "enum" in schema:
        return max(schema["enum"], key=lambda v: len(json.dumps(v)))
    kind = schema.get("type")
    if kind == "object":
        return {k: largest_instance(v) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [largest_instance(schema["items"])] * schema.get("maxItems", 4)
    if kind == "string":
        return "Q" * schema.get("maxLength", 16)  # "Q" never merges with itself in the tiny vocabularies
    if kind == "integer":
        return -abs(schema.get("maximum", 10**9))
    if kind == "number":
        return -abs(schema.get("maximum", 10**6)) - 0.123456  # a few decimals past the integer part
    return False


def finish_table(models: dict[str, str], requests: int) -> None:
    """Per tiny model: JSON-schema requests at temperature 1 whose max_tokens is exactly the budget of the
    compact rendering of their schema's largest instance; how many finish (`stop`), and how many of those
    validate, with the default (compact) whitespace and with vLLM's default (any whitespace)."""
    import jsonschema

    from engine import LLM, SamplingParams, StructuredOutputsParams

    print("| model | whitespace | finished (stop) within the compact budget | finished and valid | budgets (tokens) |")
    print("| --- | --- | --- | --- | --- |")
    for name, path in models.items():
        llm = LLM(path, dtype="float32", device="cpu", seed=0, attention_backend="torch")
        tokenizer = llm.get_tokenizer()
        all_schemas = schemas()
        budgets = [
            len(tokenizer.encode(json.dumps(largest_instance(s), separators=(",", ":")), add_special_tokens=False))
            for s in all_schemas
        ]
        rng = random.Random(1)
        prompts = [
            {"prompt_token_ids": [rng.randrange(100, 400) for _ in range(rng.randint(8, 64))]} for _ in range(requests)
        ]
        for label, whitespace in (("compact (default)", None), ("any (vLLM's default)", False)):
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=budgets[i % len(all_schemas)],
                    structured_outputs=StructuredOutputsParams(
                        json=all_schemas[i % len(all_schemas)], disable_any_whitespace=whitespace
                    ),
                )
                for i in range(requests)
            ]
            outs = llm.generate(prompts, params, use_tqdm=False)
            finished = valid = 0
            for i, out in enumerate(outs):
                c = out.outputs[0]
                if c.finish_reason == "stop":
                    finished += 1
                    try:
                        jsonschema.validate(json.loads(c.text), all_schemas[i % len(all_schemas)])
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
            print(
                f"| {name} | {label} | {finished}/{requests} ({100 * finished / requests:.0f}%) | "
                f"{valid}/{finished} | {min(budgets)}-{max(budgets)} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--finish-only",
        action="store_true",
        help="only the table of outputs finishing within the compact budget (the tiny models)",
    )
    args = parser.parse_args()

    from engine.testing.tiny import ARCHITECTURES, write_tiny_model

    root = tempfile.mkdtemp()
    models = {f"tiny {arch}": str(write_tiny_model(f"{root}/{arch}", arch)) for arch in ARCHITECTURES}
    models["bench qwen3 (~25M)"] = str(write_tiny_model(f"{root}/bench-qwen3", "qwen3", **BENCH_CONFIG))
    finish_table(models, args.requests)
    if args.finish_only:
        return

    import engine.core.llm_engine
    import engine.sampling.sampler
    from engine import LLM, SamplingParams, StructuredOutputsParams

    grammar_s = [0.0]

    def timed(fn):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                grammar_s[0] += time.perf_counter() - start

        return wrapper

    engine.sampler.apply_grammar_bitmask = timed(engine.sampler.apply_grammar_bitmask)
    engine.llm_engine.advance = timed(engine.llm_engine.advance)

    llm = LLM(models["bench qwen3 (~25M)"], dtype="float32", device=args.device, seed=0)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(BENCH_CONFIG["vocab_size"]) for _ in range(rng.randint(16, 128))]}
        for _ in range(args.requests)
    ]
    # compact JSON (the default): a random model otherwise spends its tokens on free whitespace
    specs = [StructuredOutputsParams(json=s) for s in schemas()]

    start = time.perf_counter()  # cold: every grammar compiled once (the cache keeps them)
    llm.generate(
        prompts[: len(specs)], [SamplingParams(max_tokens=1, structured_outputs=s) for s in specs], use_tqdm=False
    )
    compile_s = time.perf_counter() - start

    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=specs[i % len(specs)])
        for i in range(args.requests)
    ]
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]  # seeded: the same in every round
    valid = sum(_parses(o.outputs[0].text) for o in outs)
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    best = {"structured": float("inf"), "free": float("inf")}
    grammar_share = 1.0
    for r in range(args.rounds):
        for name in ("structured", "free") if r % 2 == 0 else ("free", "structured"):
            grammar_s[0] = 0.0
            start = time.perf_counter()
            outs = llm.generate(prompts, constrained if name == "structured" else free, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert [len(o.outputs[0].token_ids) for o in outs] == lengths
            best[name] = min(best[name], elapsed)
            if name == "structured":
                grammar_share = min(grammar_share, grammar_s[0] / elapsed)
            print(f"  round {r + 1}: {name} {elapsed:.2f} s", flush=True)
    structured_s, free_s = best["structured"], best["free"]

    tokens = sum(lengths)
    print(
        f"{args.requests} requests, {tokens} output tokens each run, device {args.device}, "
        f"fastest of {args.rounds} alternating rounds; "
        f"{valid}/{args.requests} constrained outputs parse as JSON (the rest hit max_tokens)"
    )
    print(f"grammar compile, cold (8 schemas): {compile_s:.2f} s")
    print("| run | seconds | output tok/s |")
    print("| --- | --- | --- |")
    print(f"| unconstrained | {free_s:.2f} | {tokens / free_s:.0f} |")
    print(f"| structured (json schema) | {structured_s:.2f} | {tokens / structured_s:.0f} |")
    print(
        f"ratio structured/unconstrained: {free_s / structured_s:.2f}x (target >= 0.8x); grammar work "
        f"(masks, matcher updates) {100 * grammar_share:.1f}% of the structured run"
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
