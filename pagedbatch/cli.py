"""`pagedbatch` command line. Each subcommand imports what it needs lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_API_URL = "http://127.0.0.1:8000"


def _cmd_tiny_model(args) -> int:
    from engine.tiny import write_tiny_model

    print(write_tiny_model(args.path, arch=args.arch, seed=args.seed))
    return 0


# ---- offline -------------------------------------------------------------------------------


def _cmd_run(args) -> int:
    import dataclasses

    from workers.offline import run_offline

    defaults = json.loads(args.defaults) if args.defaults else None
    summary = run_offline(
        args.input,
        args.output,
        args.model,
        progress=not args.quiet,
        engine_kwargs=_engine_kwargs(args),
        defaults=defaults,
        model_name=args.model_name,
    )
    print(json.dumps(dataclasses.asdict(summary)), file=sys.stderr)
    return 0


# ---- servers ----------------------------------------------------------------------------------


def _settings(args, **overrides):
    from store.settings import Settings, parse_models

    models = parse_models(getattr(args, "model", None)) or None
    return Settings.from_env(models=models, **overrides)


def _cmd_migrate(args) -> int:
    from store.migrate import upgrade

    settings = _settings(args)
    upgrade(settings.database_url)
    print("database is at the latest schema", file=sys.stderr)
    return 0


def _cmd_api(args) -> int:
    from gunicorn.app.base import BaseApplication

    from api.app import create_app

    settings = _settings(args)
    app = create_app(settings)

    class _Gunicorn(BaseApplication):
        def load_config(self):
            self.cfg.set("bind", f"{args.host}:{args.port}")
            self.cfg.set("workers", args.workers)
            self.cfg.set("threads", args.threads)
            self.cfg.set("worker_class", "gthread")
            self.cfg.set("timeout", 300)

        def load(self):
            return app

    _Gunicorn().run()
    return 0


def _engine_kwargs(args) -> dict:
    kwargs = {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    if getattr(args, "num_kv_blocks", None):
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    return kwargs


def _cmd_worker(args) -> int:
    import logging

    from store.settings import parse_models

    models = parse_models(args.model)
    if len(models) != 1:
        raise SystemExit("pagedbatch worker: give exactly one --model NAME=PATH (one engine per worker)")
    ((name, path),) = models.items()
    settings = _settings(args)
    settings.models = {**settings.models, name: path}
    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from engine import LLMEngine
    from workers import tasks
    from workers.cancel import CancelWatcher
    from workers.celery_app import make_celery
    from workers.engine_host import EngineHost, set_host
    from workers.priority import lower_this_thread

    host = EngineHost.load(lambda: LLMEngine(model=path, **_engine_kwargs(args)))
    if args.bookkeeping_nice:  # every thread started from here on yields to the engine's
        lower_this_thread(args.bookkeeping_nice)
    set_host(host)
    watcher = CancelWatcher(settings, host)
    tasks.configure(settings, host, watcher)
    app = make_celery(settings)
    print(
        f"pagedbatch worker: model {name} from {path}, queue {settings.queue_for(name)}, "
        f"engine loop thread {host.loop_thread_id}",
        file=sys.stderr,
    )
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={args.concurrency}",
            f"--queues={settings.queue_for(name)}",
            f"--hostname={name}-{os.getpid()}@%h",
            f"--loglevel={args.loglevel}",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--prefetch-multiplier=1",
        ]
    )
    watcher.close()
    host.close()
    return 0


def _exit_on_signal(signum, frame):
    raise SystemExit(0)


def _cmd_serve(args) -> int:
    """The API and one worker per model with an embedded PostgreSQL and Redis (unless URLs are set)."""
    import signal
    import subprocess
    from pathlib import Path

    from werkzeug.serving import make_server

    from api.app import create_app
    from store.migrate import upgrade

    home = Path(args.data_dir or os.environ.get("PAGEDBATCH_HOME", "~/.pagedbatch")).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    settings = _settings(args)
    if not settings.models:
        raise SystemExit("pagedbatch serve: give at least one --model NAME=PATH")
    embedded = []
    if not os.environ.get("PAGEDBATCH_STORAGE_URL"):
        settings.storage_url = str(home / "storage")
    if not settings.database_url:
        from pagedbatch.embedded import EmbeddedPostgres

        pg = EmbeddedPostgres(home / "pgdata")
        embedded.append(pg)
        settings.database_url = pg.database_url("pagedbatch")
    if not settings.broker_url:
        from pagedbatch.embedded import EmbeddedRedis

        redis = EmbeddedRedis(home / "redis.db")
        embedded.append(redis)
        settings.broker_url = redis.url
    upgrade(settings.database_url)
    _announce_local_key(settings, home)
    env = {**os.environ, **settings.to_env()}
    workers = []
    for name, path in settings.models.items():
        cmd = [
            sys.executable,
            "-m",
            "pagedbatch",
            "worker",
            "--model",
            f"{name}={path}",
            f"--concurrency={args.concurrency}",
            f"--device={args.device}",
            f"--dtype={args.dtype}",
            f"--max-num-seqs={args.max_num_seqs}",
            "--loglevel=warning",
        ]
        workers.append(subprocess.Popen(cmd, env=env))
    app = create_app(settings)
    server = make_server(args.host, args.port, app, threaded=True)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    print(
        f"pagedbatch serving on http://{args.host}:{server.server_port} "
        f"(models: {', '.join(settings.models)}; data in {home})",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        for proc in workers:
            proc.terminate()
        for proc in workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for service in reversed(embedded):
            service.stop()
    return 0


def _announce_local_key(settings, home) -> str:
    """Create (first start) or reuse `serve`'s API key, saved in the data dir, and say where it is."""
    from store.keys import ensure_local_key, local_key_path

    key, created = ensure_local_key(settings, home)
    where = local_key_path(home)
    if created:
        print(
            f"pagedbatch: created an API key for tenant {settings.default_tenant!r}: {key}\n"
            f"pagedbatch: it is saved in {where}; clients on this machine use it by default "
            "(or send it as Authorization: Bearer, --api-key or PAGEDBATCH_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"pagedbatch: using the API key saved in {where}", file=sys.stderr, flush=True)
    return key


# ---- keys and tenants -----------------------------------------------------------------------------


def _admin_settings(args):
    from store.settings import Settings

    settings = Settings.from_env()
    if args.database_url:
        settings.database_url = args.database_url
    if not settings.database_url:
        raise SystemExit("pagedbatch: set PAGEDBATCH_DATABASE_URL or give --database-url")
    return settings


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _cmd_keys_create(args) -> int:
    from store.keys import create_key

    key, info = create_key(_admin_settings(args), args.tenant, name=args.name)
    print(f"created {info.id} for tenant {info.tenant!r}; the key is shown only this once:", file=sys.stderr)
    print(key)
    return 0


def _cmd_keys_list(args) -> int:
    from store.keys import list_keys

    rows = list_keys(_admin_settings(args), args.tenant)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "id": k.id,
                        "tenant": k.tenant,
                        "prefix": k.prefix,
                        "name": k.name,
                        "created_at": k.created_at.isoformat(),
                        "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None,
                    }
                    for k in rows
                ],
                indent=2,
            )
        )
        return 0
    table = [("ID", "TENANT", "PREFIX", "CREATED", "REVOKED", "NAME")]
    table += [(k.id, k.tenant, k.prefix + "...", _when(k.created_at), _when(k.revoked_at), k.name or "") for k in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _cmd_keys_revoke(args) -> int:
    from store.keys import revoke_key

    try:
        info = revoke_key(_admin_settings(args), args.key_id)
    except KeyError:
        print(f"pagedbatch: no key {args.key_id}", file=sys.stderr)
        return 1
    print(f"revoked {info.id} (tenant {info.tenant!r}, {info.prefix}...)", file=sys.stderr)
    return 0


def _cmd_tenants_set(args) -> int:
    from store.keys import set_tenant_limits

    row = set_tenant_limits(
        _admin_settings(args),
        args.tenant,
        max_active_jobs=args.max_active_jobs,
        max_queued_requests=args.max_queued_requests,
    )
    print(
        f"tenant {row.name!r}: max active jobs {_limit(row.max_active_jobs)}, "
        f"max queued requests {_limit(row.max_queued_requests)}"
    )
    return 0


def _limit(value) -> str:
    return "default" if value is None else "unlimited" if value == 0 else str(value)


def _cmd_tenants_list(args) -> int:
    from store.keys import list_tenants

    for row in list_tenants(_admin_settings(args)):
        print(
            f"{row.name}\tmax_active_jobs={_limit(row.max_active_jobs)}\t"
            f"max_queued_requests={_limit(row.max_queued_requests)}"
        )
    return 0


# ---- client -------------------------------------------------------------------------------------


def _api_key(args) -> str | None:
    """--api-key, else PAGEDBATCH_API_KEY, else (for a server on this machine) `serve`'s saved key."""
    from urllib.parse import urlparse

    if getattr(args, "api_key", None):
        return args.api_key
    if os.environ.get("PAGEDBATCH_API_KEY"):
        return os.environ["PAGEDBATCH_API_KEY"]
    if urlparse(args.url).hostname in ("127.0.0.1", "localhost", "::1"):
        from store.keys import read_local_key

        return read_local_key(os.environ.get("PAGEDBATCH_HOME", "~/.pagedbatch"))
    return None


def _client(args):
    from pagedbatch.client import Client

    return Client(args.url, api_key=_api_key(args))


def _cmd_submit(args) -> int:
    client = _client(args)
    job = client.submit(
        args.file,
        model=args.model,
        defaults=json.loads(args.defaults) if args.defaults else None,
        metadata=json.loads(args.metadata) if args.metadata else None,
        progress=not args.quiet,
    )
    counts = job["request_counts"]
    print(
        f"job {job['id']}: {job['status']}, {counts['valid']} valid / {counts['invalid']} invalid lines",
        file=sys.stderr,
    )
    print(job["id"])
    if args.wait or args.output:
        job = client.wait(job["id"], progress=not args.quiet)
        if args.output:
            client.download(job["id"], args.output, progress=not args.quiet)
        return 0 if job["status"] == "completed" else 1
    return 0


def _cmd_status(args) -> int:
    print(json.dumps(_client(args).job(args.job_id), indent=2))
    return 0


def _cmd_wait(args) -> int:
    job = _client(args).wait(args.job_id, timeout=args.timeout, progress=not args.quiet)
    print(json.dumps(job, indent=2))
    return 0 if job["status"] == "completed" else 1


def _cmd_download(args) -> int:
    client = _client(args)
    path = client.download(
        args.job_id, args.output, fmt=args.format, errors=args.errors, progress=not args.quiet
    )
    print(path)
    return 0


# ---- parser -------------------------------------------------------------------------------------


def _add_engine_args(p) -> None:
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbatch", description="Batch inference for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight model directory")
    tiny.add_argument("path")
    tiny.add_argument("--arch", default="qwen3", choices=["llama", "mistral", "qwen2", "qwen3"])
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_tiny_model)

    run = sub.add_parser("run", help="offline: run a JSONL file through the engine into Parquet, no servers")
    run.add_argument("input")
    run.add_argument("-o", "--output", required=True)
    run.add_argument("--model", required=True, help="model directory")
    run.add_argument(
        "--model-name", default=None, help="the model name in responses (default: directory name)"
    )
    run.add_argument("--defaults", help="JSON object of default body fields")
    run.add_argument("-q", "--quiet", action="store_true")
    _add_engine_args(run)
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser("serve", help="API + workers with embedded PostgreSQL and Redis, one command")
    serve.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default=None, help="default: $PAGEDBATCH_HOME or ~/.pagedbatch")
    serve.add_argument("--concurrency", type=int, default=4, help="shard tasks in flight per worker")
    _add_engine_args(serve)
    serve.set_defaults(func=_cmd_serve)

    api = sub.add_parser("api", help="the API under gunicorn (PAGEDBATCH_* environment variables)")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument("--workers", type=int, default=2)
    api.add_argument("--threads", type=int, default=8)
    api.add_argument(
        "--model",
        action="append",
        metavar="NAME=PATH",
        help="models to validate against (or PAGEDBATCH_MODELS)",
    )
    api.set_defaults(func=_cmd_api)

    worker = sub.add_parser("worker", help="a Celery worker with one engine, for one model's queue")
    worker.add_argument("--model", action="append", required=True, metavar="NAME=PATH")
    worker.add_argument("--concurrency", type=int, default=4, help="shard tasks in flight at once")
    worker.add_argument("--num-kv-blocks", type=int, default=None)
    worker.add_argument("--loglevel", default="info")
    worker.add_argument(
        "--bookkeeping-nice", type=int, default=10, metavar="N",
        help="nice value added to the worker's own threads (Celery, shard tasks), not the engine's; 0: off",
    )  # fmt: skip
    _add_engine_args(worker)
    worker.set_defaults(func=_cmd_worker)

    keys = sub.add_parser("keys", help="API keys: create, list, revoke").add_subparsers(
        dest="keys_command", required=True
    )
    tenants = sub.add_parser("tenants", help="tenants' limits").add_subparsers(dest="tenants_command", required=True)

    def admin_parser(group, name: str, help: str):
        p = group.add_parser(name, help=help)
        p.add_argument("--database-url", default=None, help="default: $PAGEDBATCH_DATABASE_URL")
        return p

    kc = admin_parser(keys, "create", "create a key for a tenant; prints the key, once")
    kc.add_argument("--tenant", default=None, help="default: the tenant named default")
    kc.add_argument("--name", default=None, help="a label to tell keys apart")
    kc.set_defaults(func=_cmd_keys_create)
    kl = admin_parser(keys, "list", "list keys (id, tenant, prefix, created, revoked; never the key)")
    kl.add_argument("--tenant", default=None)
    kl.add_argument("--json", action="store_true")
    kl.set_defaults(func=_cmd_keys_list)
    kr = admin_parser(keys, "revoke", "revoke a key by its id")
    kr.add_argument("key_id")
    kr.set_defaults(func=_cmd_keys_revoke)
    ts = admin_parser(tenants, "set", "set a tenant's limits (0: unlimited; omitted: the server's default)")
    ts.add_argument("tenant")
    ts.add_argument("--max-active-jobs", type=int, default=None)
    ts.add_argument("--max-queued-requests", type=int, default=None)
    ts.set_defaults(func=_cmd_tenants_set)
    admin_parser(tenants, "list", "list tenants and their limits").set_defaults(func=_cmd_tenants_list)

    migrate = sub.add_parser("migrate", help="upgrade the database schema to the latest migration")
    migrate.set_defaults(func=_cmd_migrate)

    def client_parser(name: str, help: str):
        p = sub.add_parser(name, help=help)
        p.add_argument("--url", default=os.environ.get("PAGEDBATCH_API_URL", DEFAULT_API_URL))
        p.add_argument(
            "--api-key",
            default=None,
            help="default: $PAGEDBATCH_API_KEY, else the key `serve` saved in $PAGEDBATCH_HOME (local URLs)",
        )
        p.add_argument("-q", "--quiet", action="store_true")
        return p

    submit = client_parser("submit", "upload a JSONL file as a job; prints the job id")
    submit.add_argument("file")
    submit.add_argument("--model", required=True)
    submit.add_argument("--defaults", help="JSON object of default body fields, e.g. '{\"max_tokens\": 64}'")
    submit.add_argument("--metadata", help="JSON object")
    submit.add_argument("--wait", action="store_true", help="wait for the job to finish")
    submit.add_argument("-o", "--output", help="wait, then download the results here")
    submit.set_defaults(func=_cmd_submit)

    status = client_parser("status", "print a job")
    status.add_argument("job_id")
    status.set_defaults(func=_cmd_status)

    wait = client_parser("wait", "wait for a job to finish, with a progress bar")
    wait.add_argument("job_id")
    wait.add_argument("--timeout", type=float, default=None)
    wait.set_defaults(func=_cmd_wait)

    download = client_parser("download", "download a job's results (Parquet, or --format jsonl)")
    download.add_argument("job_id")
    download.add_argument("-o", "--output", required=True)
    download.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    download.add_argument("--errors", action="store_true", help="download the error lines instead")
    download.set_defaults(func=_cmd_download)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
