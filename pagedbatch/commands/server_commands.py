"""Commands that run the platform's servers: `migrate`, `api`, `worker`, and `serve` (all of them at once).

They read PAGEDBATCH_* environment variables (see `store.settings`); `--model` adds to them.
"""

from __future__ import annotations

import os
import sys

from pagedbatch.arguments import model_directory
from pagedbatch.engine_options import add_engine_options, engine_kwargs, lora_modules
from pagedbatch.failures import CliError, database_errors, usage_error
from settings import WorkerSettings, current
from store.logs import FORMATS, configure_logging
from workers.priority import BOOKKEEPING_NICE, WORKER_OPENMP_SPINS, shorten_openmp_spins


def settings_from(args, **overrides):
    """The settings from the environment, with `--model` items (when given) as the models."""
    from store.settings import Settings, parse_models

    try:
        models = parse_models(getattr(args, "model", None)) or None
        return Settings.from_env(models=models, **overrides)
    except ValueError as exc:  # a --model without NAME=PATH, a PAGEDBATCH_* variable that is not a number
        raise usage_error(f"bad setting: {exc}") from exc


def checked_models(settings) -> None:
    """Every model path is a model directory (before any server starts)."""
    for name, path in settings.models.items():
        model_directory(path, flag=f"--model {name}")


def _migrate(args) -> int:
    from migrations import script_heads, upgrade, wait_for_head

    settings = settings_from(args)
    if not settings.database_url:
        raise usage_error("set PAGEDBATCH_DATABASE_URL to the database to upgrade")
    if args.wait is not None:
        with database_errors(lambda: settings.database_url):
            at_head = wait_for_head(settings.database_url, args.wait)
        if not at_head:
            print(f"database not at schema {','.join(sorted(script_heads()))} after {args.wait:g}s", file=sys.stderr)
            return 1
        print("database is at this version's schema", file=sys.stderr)
        return 0
    with database_errors(lambda: settings.database_url):
        upgrade(settings.database_url)
    print("database is at the latest schema", file=sys.stderr)
    return 0


def _api(args) -> int:
    settings = settings_from(args)
    checked_models(settings)  # the app reads every model's tokenizer as it starts
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
    GunicornApp(create_app(settings), options).run()
    return 0


def _worker(args) -> int:
    from store.settings import parse_models

    settings = settings_from(args)
    models = parse_models(args.model)
    if len(models) != 1:
        raise usage_error("worker: give exactly one --model NAME=PATH (one engine per worker)")
    ((name, path),) = models.items()
    if not args.engine_factory:  # a test's factory may take any path
        model_directory(path, flag=f"--model {name}")
    checked_loras(args, 1)
    configure_logging(args.loglevel, args.log_format)
    if shorten_openmp_spins():  # before torch loads
        print(f"pagedbatch worker: OpenMP threads spin {WORKER_OPENMP_SPINS} iterations, then sleep", file=sys.stderr)
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
        loras=lora_modules(args),
    )
    return 0


def checked_loras(args, model_count: int) -> None:
    """--lora NAME=DIR items readable, and one model for them to go over."""
    try:
        modules = lora_modules(args)
    except ValueError as exc:
        raise usage_error(str(exc)) from exc
    if modules and model_count != 1:
        raise usage_error(
            "--lora: give exactly one --model (the adapters' base); for adapters over several "
            "models, start a worker per model with its own --lora"
        )


def check_port_free(host: str, port: int) -> None:
    """Before anything starts: the address `serve` will listen on is free."""
    import socket

    try:
        with socket.create_server((host, port), reuse_port=False):
            pass
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else (exc.strerror or str(exc))
        raise CliError(f"cannot listen on {host}:{port}: {reason} (another 'pagedbatch serve'? give --port)") from exc


def _serve(args) -> int:
    settings = settings_from(args)
    checked_models(settings)
    checked_loras(args, len(settings.models))
    check_port_free(args.host, args.port)
    from pagedbatch.supervisor import serve

    return serve(args, settings)


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
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the workers' Prometheus ports: PORT for the first model's worker, PORT+1 for the next, ...",
    )
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
        "--bookkeeping-nice",
        type=int,
        default=BOOKKEEPING_NICE,
        metavar="N",
        help="nice value added to the worker's own threads (Celery, shard tasks), not the engine's; 0: off",
    )
    worker.add_argument(
        "--engine-factory",
        default=None,
        metavar="MODULE:CALLABLE",
        help="build the engine with this callable, given engine.LLMEngine's keyword arguments "
        "(default: engine.LLMEngine); tests use it for engines that fail on purpose",
    )
    worker.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics on this port"
    )
    worker.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="both: prefill and decode here (default); decode: take shards, prefill on the prefill workers "
        "(locally when none is alive); prefill: serve prefills to decode workers, take no shards",
    )
    worker.add_argument(
        "--drain-timeout",
        type=float,
        default=current(WorkerSettings).worker_drain_s,
        metavar="SECONDS",
        help="on SIGTERM, take no new shard and let the running ones finish for up to SECONDS, then hand the "
        "rest back to the queue (default 0: hand back at once; PAGEDBATCH_WORKER_DRAIN_S)",
    )
    _add_log_format(worker)
    add_engine_options(worker)
    worker.set_defaults(func=_worker)

    migrate = commands.add_parser("migrate", help="upgrade the database schema to the latest migration")
    migrate.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="do not migrate: wait until the database is at this version's schema (exit 1 after SECONDS)",
    )
    migrate.set_defaults(func=_migrate)
