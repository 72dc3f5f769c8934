"""Commands that run the engine in this process, with no servers: `tiny-model` and `run`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.testing.tiny import ARCHITECTURES as TINY_ARCHITECTURES
from pagedbatch.arguments import json_object, model_directory, readable_file, writable_output
from pagedbatch.engine_options import add_engine_options, engine_kwargs, lora_modules
from pagedbatch.failures import (
    EXIT_LINES_FAILED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    usage_error,
)
from settings import is_set


def _dimensions(text: str) -> list[int]:
    try:
        dims = [int(d) for d in text.split(",")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected sizes such as 16,32,64, got {text!r}")
    return dims


def _tiny_model(args) -> int:
    try:
        Path(args.path).mkdir(parents=True, exist_ok=True)  # before torch loads: a path that cannot be written
        if args.encoder:
            from engine.testing.tiny_encoder import write_tiny_classifier, write_tiny_encoder

            if args.cross_encoder or args.classifier:
                labels = 1 if args.cross_encoder else args.classifier
                path = write_tiny_classifier(args.path, args.encoder, num_labels=labels, seed=args.seed)
            else:
                path = write_tiny_encoder(
                    args.path,
                    args.encoder,
                    pooling=args.pooling or "mean",
                    normalize=not args.no_normalize,
                    seed=args.seed,
                )
        elif args.cross_encoder or args.classifier:
            raise usage_error("--cross-encoder and --classifier need --encoder")
        elif args.embedding:
            from engine.testing.tiny_embedding import write_tiny_embedding_model

            path = write_tiny_embedding_model(
                args.path,
                arch=args.arch,
                pooling=args.pooling or "last",
                seed=args.seed,
                normalize=not args.no_normalize,
                matryoshka_dimensions=args.matryoshka,
            )
        else:
            from engine.testing.tiny import write_tiny_model

            path = write_tiny_model(args.path, arch=args.arch, seed=args.seed)
    except OSError as exc:
        raise usage_error(f"cannot write the model to {args.path}: {exc.strerror or exc}") from exc
    print(path)
    return EXIT_OK


def _run(args) -> int:
    readable_file(args.input)
    model_dir = model_directory(args.model)
    writable_output(args.output)
    from workers.offline import NoRequests, check_has_requests, run_offline

    try:  # before the model loads: a file with no request line is an input error
        check_has_requests(args.input, model_dir, defaults=args.defaults, model_name=args.model_name)
    except NoRequests as exc:
        raise usage_error(str(exc)) from exc
    except (OSError, ValueError) as exc:  # the tokenizer or config cannot be read
        raise usage_error(f"--model {args.model}: cannot read its tokenizer or config: {exc}") from exc
    _choose_startup(args)
    from engine import LLM

    try:
        lora_modules(args)  # a bad --lora is a usage error before the model loads
        llm = LLM(model=str(model_dir), **engine_kwargs(args))
    except ValueError as exc:  # an unsupported architecture, a bad option for this model or machine
        raise usage_error(f"cannot load the model in {args.model}: {exc}") from exc
    summary = run_offline(
        args.input,
        args.output,
        model_dir,
        progress=not args.quiet,
        defaults=args.defaults,
        model_name=args.model_name,
        llm=llm,
        loras=lora_modules(args),
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(summary)))
    print(
        f"pagedbatch: {summary.total} lines: {summary.completed} completed, {summary.failed} failed, "
        f"{summary.cancelled} cancelled, {summary.completion_tokens} tokens generated in "
        f"{summary.elapsed_s:.1f} s; results in {summary.output_path}",
        file=sys.stderr,
    )
    return EXIT_LINES_FAILED if args.strict and summary.failed + summary.cancelled else EXIT_OK


QUICK_START_LINES = 256  # up to this many lines, compiling the kernels costs more than it saves


def _choose_startup(args) -> None:
    """--startup auto: a quick start (nothing compiled up front, `pagedbatch_kernels.startup`) for a small
    file, unless PAGEDBATCH_STARTUP says otherwise."""
    from pagedbatch_kernels import startup

    if args.startup != "auto":
        startup.use(args.startup)
    elif not is_set(startup.ENV):
        from batchfile.lines import count_lines

        with open(args.input, "rb") as f:
            small = count_lines(f).lines <= QUICK_START_LINES
        startup.use("quick" if small else "full")


def add_commands(commands) -> None:
    tiny = commands.add_parser("tiny-model", help="write a tiny random-weight model directory")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="qwen3", choices=TINY_ARCHITECTURES)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--embedding",
        action="store_true",
        help="a sentence-transformers embedding model (no LM head) instead of a causal LM",
    )
    tiny.add_argument(
        "--pooling",
        default=None,
        choices=["last", "mean", "cls"],
        help="with --embedding (default last) or --encoder (default mean)",
    )
    tiny.add_argument(
        "--encoder",
        choices=["bert", "xlm-roberta", "modernbert", "nomic-bert"],
        help="an encoder: a sentence-transformers embedder, or with --cross-encoder / --classifier "
        "a sequence-classification model",
    )
    tiny.add_argument("--cross-encoder", action="store_true", help="with --encoder: one label (scores, reranking)")
    tiny.add_argument("--classifier", type=int, metavar="LABELS", help="with --encoder: a classifier of LABELS labels")
    tiny.add_argument("--no-normalize", action="store_true", help="with --embedding: no Normalize module")
    tiny.add_argument(
        "--matryoshka", metavar="DIMS", type=_dimensions, help="with --embedding: Matryoshka sizes, e.g. 16,32,64"
    )
    tiny.set_defaults(func=_tiny_model)

    run = commands.add_parser(
        "run", help="offline: run a JSONL file through the engine into Parquet, no servers", epilog=EXIT_STATUS_HELP
    )
    run.add_argument("input")
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--model", required=True, help="model directory")
    run.add_argument("--model-name", default=None, help="the model name in responses (default: directory name)")
    run.add_argument("--defaults", type=json_object, help="JSON object of default body fields")
    run.add_argument("--strict", action="store_true", help="exit with status 3 when any line failed")
    run.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    run.add_argument("-q", "--quiet", action="store_true")
    run.add_argument(
        "--startup",
        choices=["auto", "quick", "full"],
        default="auto",
        help=f"quick: compile no kernel up front (faster for a few requests); full: compile and time "
        f"them first (faster for many); auto (default): quick up to {QUICK_START_LINES} lines",
    )
    add_engine_options(run)
    run.set_defaults(func=_run)
