"""Users' commands against a running API: `submit`, `status`, `wait` and `download`."""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlparse

DEFAULT_API_URL = "http://127.0.0.1:8000"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def api_key(args) -> str | None:
    """--api-key, else PAGEDBATCH_API_KEY, else (for a server on this machine) `serve`'s saved key."""
    if getattr(args, "api_key", None):
        return args.api_key
    if os.environ.get("PAGEDBATCH_API_KEY"):
        return os.environ["PAGEDBATCH_API_KEY"]
    if urlparse(args.url).hostname in LOCAL_HOSTS:
        from store.keys import read_local_key
        from store.settings import home_dir

        return read_local_key(home_dir())
    return None


def _client(args):
    from pagedbatch.client import Client

    return Client(args.url, api_key=api_key(args))


def _submit(args) -> int:
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


def _status(args) -> int:
    job = _client(args).job(args.job_id)
    if job.get("status_detail"):  # why it waits (the storage is full, unreachable...)
        print(f"job {job['id']}: {job['status']} ({job['status_detail']})", file=sys.stderr)
    print(json.dumps(job, indent=2))
    return 0


def _wait(args) -> int:
    job = _client(args).wait(args.job_id, timeout=args.timeout, progress=not args.quiet)
    print(json.dumps(job, indent=2))
    return 0 if job["status"] == "completed" else 1


def _download(args) -> int:
    path = _client(args).download(
        args.job_id, args.output, fmt=args.format, errors=args.errors, progress=not args.quiet
    )
    print(path)
    return 0


def add_commands(commands) -> None:
    def client_parser(name: str, help: str):
        parser = commands.add_parser(name, help=help)
        parser.add_argument("--url", default=os.environ.get("PAGEDBATCH_API_URL", DEFAULT_API_URL))
        parser.add_argument(
            "--api-key",
            default=None,
            help="default: $PAGEDBATCH_API_KEY, else the key `serve` saved in $PAGEDBATCH_HOME (local URLs)",
        )
        parser.add_argument("-q", "--quiet", action="store_true")
        return parser

    submit = client_parser("submit", "upload a JSONL file as a job; prints the job id")
    submit.add_argument("file")
    submit.add_argument("--model", required=True)
    submit.add_argument("--defaults", help="JSON object of default body fields, e.g. '{\"max_tokens\": 64}'")
    submit.add_argument("--metadata", help="JSON object")
    submit.add_argument("--wait", action="store_true", help="wait for the job to finish")
    submit.add_argument("-o", "--output", help="wait, then download the results here")
    submit.set_defaults(func=_submit)

    status = client_parser("status", "print a job")
    status.add_argument("job_id")
    status.set_defaults(func=_status)

    wait = client_parser("wait", "wait for a job to finish, with a progress bar")
    wait.add_argument("job_id")
    wait.add_argument("--timeout", type=float, default=None)
    wait.set_defaults(func=_wait)

    download = client_parser("download", "download a job's results (Parquet, or --format jsonl)")
    download.add_argument("job_id")
    download.add_argument("-o", "--output", required=True)
    download.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    download.add_argument("--errors", action="store_true", help="download the error lines instead")
    download.set_defaults(func=_download)
