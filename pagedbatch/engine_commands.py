"""Commands that run the engine in this process, with no servers: `tiny-model` and `run`."""

from __future__ import annotations

import dataclasses
import json
import sys

from pagedbatch.engine_options import add_engine_options, engine_kwargs


def _tiny_model(args) -> int:
    if args.embedding:
        from engine.tiny_embedding import write_tiny_embedding_model

        dims = [int(d) for d in args.matryoshka.split(",")] if args.matryoshka else None
        print(write_tiny_embedding_model(args.path, arch=args.arch, pooling=args.pooling, seed=args.seed,
                                         normalize=not args.no_normalize, matryoshka_dimensions=dims))
        return 0
    from engine.tiny import write_tiny_model

    print(write_tiny_model(args.path, arch=args.arch, seed=args.seed))
    return 0


def _run(args) -> int:
    from workers.offline import run_offline

    summary = run_offline(
        args.input,
        args.output,
        args.model,
        progress=not args.quiet,
        engine_kwargs=engine_kwargs(args),
        defaults=json.loads(args.defaults) if args.defaults else None,
        model_name=args.model_name,
    )
    print(json.dumps(dataclasses.asdict(summary)), file=sys.stderr)
    return 0


def add_commands(commands) -> None:
    tiny = commands.add_parser("tiny-model", help="write a tiny random-weight model directory")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="qwen3", choices=["llama", "mistral", "qwen2", "qwen3", "mixtral",
                                                                 "qwen2_moe", "qwen3_moe"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--embedding", action="store_true",
                      help="a sentence-transformers embedding model (no LM head) instead of a causal LM")
    tiny.add_argument("--pooling", default="last", choices=["last", "mean", "cls"], help="with --embedding")
    tiny.add_argument("--no-normalize", action="store_true", help="with --embedding: no Normalize module")
    tiny.add_argument("--matryoshka", metavar="DIMS", help="with --embedding: Matryoshka sizes, e.g. 16,32,64")
    tiny.set_defaults(func=_tiny_model)

    run = commands.add_parser("run", help="offline: run a JSONL file through the engine into Parquet, no servers")
    run.add_argument("input")
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--model", required=True, help="model directory")
    run.add_argument("--model-name", default=None, help="the model name in responses (default: directory name)")
    run.add_argument("--defaults", help="JSON object of default body fields")
    run.add_argument("-q", "--quiet", action="store_true")
    add_engine_options(run)
    run.set_defaults(func=_run)
