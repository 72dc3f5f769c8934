"""Commands that run the platform's servers: `migrate`, `api`, `worker`, and `serve` (all of them at once).

They read PAGEDBATCH_* environment variables (see `store.settings`); `--model` adds to them.
"""

from __future__ import annotations

import os
import sys

from pagedbatch.engine_options import add_engine_options, engine_kwargs
from store.logs import FORMATS, configure_logging
from workers.priority import BOOKKEEPING_NICE


def settings_from(args, **overrides):
    """The settings from the environment, with `--model` items (when given) as the models."""
    from store.settings import Settings, parse_models

    models = parse_models(getattr(args, "model", None)) or None
    return Settings.from_env(models=models, **overrides)


def _migrate(args) -> int:
    from migrations import script_heads, upgrade, wait_for_head

    if args.wait is not None:
        if not wait_for_head(settings_from(args).database_url, args.wait):
            print(f"database not at schema {','.join(sorted(script_heads()))} after {args.wait:g}s", file=sys.stderr)
            return 1
        print("database is at this version's schema", file=sys.stderr)
        return 0
    upgrade(settings_from(args).database_url)
    print("database is at the latest schema", file=sys.stderr)
    return 0


def _api(args) -> int:
    from pagedbatch.gunicorn_app import GunicornApp, child_exit, prepare_metrics_dir

    prepare_metrics_dir()  # before api.app loads prometheus_client: the workers' metrics add up
    configure_logging("INFO", args.log_format)
    from api.app import create_app

    options = {
        "child_exit": child_exit,
        "bind": f"{args.host}:{args.port}",
        "workers": args.workers,
        "threads": args.threads,
        "worker_class": "api.server_errors.JsonErrorWorker",  # gthread, with its own errors as JSON
        "timeout": 300,
    }
    GunicornApp(create_app(settings_from(args)), options).run()
    return 0


def _worker(args) -> int:
    from store.settings import parse_models

    models = parse_models(args.model)
    if len(models) != 1:
        raise SystemExit("pagedbatch worker: give exactly one --model NAME=PATH (one engine per worker)")
    ((name, path),) = models.items()
    settings = settings_from(args)
    configure_logging(args.loglevel, args.log_format)
    from workers.process import run_worker

    run_worker(
        settings,
        name,
        path,
        engine_kwargs=engine_kwargs(args),
        engine_factory=args.engine_factory,
        concurrency=args.concurrency,
        loglevel=args.loglevel,
        bookkeeping_nice=args.bookkeeping_nice,
        metrics_port=args.metrics_port,
        role=args.role,
        drain_s=args.drain_timeout,
    )
    return 0


def _serve(args) -> int:
    from pagedbatch.supervisor import serve

    return serve(args, settings_from(args))


def _add_log_format(parser) -> None:
    parser.add_argument(
        "--log-format", choices=FORMATS, default=None, help="log lines as JSON objects or text (PAGEDBATCH_LOG_FORMAT)"
    )


def add_commands(commands) -> None:
    serve = commands.add_parser("serve", help="API + workers with embedded PostgreSQL and Redis, one command")
    serve.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default=None, help="default: $PAGEDBATCH_HOME or ~/.pagedbatch")
    serve.add_argument("--concurrency", type=int, default=4, help="shard tasks in flight per worker")
    serve.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT",
        help="the workers' Prometheus ports: PORT for the first model's worker, PORT+1 for the next, ...",
    )  # fmt: skip
    add_engine_options(serve)
    serve.set_defaults(func=_serve)

    api = commands.add_parser("api", help="the API under gunicorn (PAGEDBATCH_* environment variables)")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--workers", type=int, default=2)
    api.add_argument("--threads", type=int, default=8)
    api.add_argument(
        "--model", action="append", metavar="NAME=PATH", help="models to validate against (or PAGEDBATCH_MODELS)"
    )
    _add_log_format(api)
    api.set_defaults(func=_api)

    worker = commands.add_parser("worker", help="a Celery worker with one engine, for one model's queue")
    worker.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    worker.add_argument("--concurrency", type=int, default=4, help="shard tasks in flight at once")
    worker.add_argument("--loglevel", default="info")
    worker.add_argument(
        "--bookkeeping-nice", type=int, default=BOOKKEEPING_NICE, metavar="N",
        help="nice value added to the worker's own threads (Celery, shard tasks), not the engine's; 0: off",
    )  # fmt: skip
    worker.add_argument(
        "--engine-factory", default=None, metavar="MODULE:CALLABLE",
        help="build the engine with this callable, given engine.LLMEngine's keyword arguments "
        "(default: engine.LLMEngine); tests use it for engines that fail on purpose",
    )  # fmt: skip
    worker.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics on this port"
    )
    worker.add_argument(
        "--role", choices=("both", "prefill", "decode"), default="both",
        help="both: prefill and decode here (default); decode: take shards, prefill on the prefill workers "
        "(locally when none is alive); prefill: serve prefills to decode workers, take no shards",
    )  # fmt: skip
    worker.add_argument(
        "--drain-timeout", type=float, default=float(os.environ.get("PAGEDBATCH_WORKER_DRAIN_S") or 0),
        metavar="SECONDS",
        help="on SIGTERM, take no new shard and let the running ones finish for up to SECONDS, then hand the "
        "rest back to the queue (default 0: hand back at once; PAGEDBATCH_WORKER_DRAIN_S)",
    )  # fmt: skip
    _add_log_format(worker)
    add_engine_options(worker)
    worker.set_defaults(func=_worker)

    migrate = commands.add_parser("migrate", help="upgrade the database schema to the latest migration")
    migrate.add_argument(
        "--wait", type=float, default=None, metavar="SECONDS",
        help="do not migrate: wait until the database is at this version's schema (exit 1 after SECONDS)",
    )  # fmt: skip
    migrate.set_defaults(func=_migrate)
