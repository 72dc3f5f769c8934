"""Users' commands against a running API: `submit`, `quote`, `status`, `wait`, `download`, `jobs`, `cancel`, `errors`.

Output convention: stdout carries the answer, a person's table by default and JSON with --json, the same
whether or not stdout is a terminal (so what a script reads is what its author saw); progress bars and
notes go to stderr. `submit` prints the job id alone on stdout (`job=$(pagedbatch submit ...)`) and its
table on stderr.
"""

from __future__ import annotations

import json
import sys
from urllib.parse import urlparse

from pagedbatch.arguments import api_url, json_object, readable_file, writable_output
from pagedbatch.failures import (
    EXIT_ERROR,
    EXIT_JOB_FAILED,
    EXIT_LINES_FAILED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    EXIT_USAGE,
    CliError,
)
from settings import ClientSettings, current

DEFAULT_API_URL = "http://127.0.0.1:8000"
URL_ENV = "PAGEDBATCH_API_URL"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
UNFINISHED_NOTE = "the job is not finished; 'pagedbatch wait JOB' waits for it"


def api_key(args) -> str | None:
    """--api-key, else PAGEDBATCH_API_KEY, else (for a server on this machine) `serve`'s saved key."""
    if getattr(args, "api_key", None):
        return args.api_key
    if current(ClientSettings).api_key:
        return current(ClientSettings).api_key
    if urlparse(args.url).hostname in LOCAL_HOSTS:
        from store.keys import read_local_key
        from store.settings import home_dir

        return read_local_key(home_dir())
    return None


class _Api:
    """The HTTP client, with its failures turned into one-line `CliError`s."""

    def __init__(self, args):
        from pagedbatch.client import Client

        self.url = args.url
        self.client = Client(args.url, api_key=api_key(args))

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            from pagedbatch.client import ApiError, Unreachable

            try:
                return method(*args, **kwargs)
            except Unreachable as exc:
                raise CliError(
                    f"cannot reach the API at {self.url} ({exc.reason}; is 'pagedbatch serve' running? "
                    f"give --url or set {URL_ENV})"
                ) from exc
            except ApiError as exc:
                # the request was wrong (unknown job, bad key, refused input): 2; rate limits and server errors: 1
                status = EXIT_USAGE if 400 <= exc.status < 500 and exc.status != 429 else EXIT_ERROR
                raise CliError(f"the API answered {exc.status}: {exc.message}", status) from exc
            except TimeoutError as exc:
                raise CliError(str(exc)) from exc

        return call


def _emit(args, job: dict) -> None:
    from pagedbatch.job_view import job_table

    print(json.dumps(job, indent=2) if args.json else job_table(job))


def job_exit_status(job: dict, strict: bool) -> int:
    """0 completed, 3 completed with failed lines under --strict, 4 failed, expired or cancelled."""
    if job["status"] != "completed":
        return EXIT_JOB_FAILED
    from pagedbatch.job_view import failed_lines

    return EXIT_LINES_FAILED if strict and failed_lines(job) else EXIT_OK


def _submit(args) -> int:
    readable_file(args.file)
    if args.output:
        writable_output(args.output)
    api = _Api(args)
    job = api.submit(
        args.file, model=args.model, defaults=args.defaults, metadata=args.metadata, progress=not args.quiet
    )
    print(job["id"])
    if not (args.wait or args.output):
        _show_submitted(args, job)
        return EXIT_OK
    job = api.wait(job["id"], progress=not args.quiet)
    if args.output and job["status"] != "failed":  # expired and cancelled jobs keep what finished
        api.download(job["id"], args.output, progress=not args.quiet)
    _show_submitted(args, job)
    return job_exit_status(job, args.strict)


def _quote(args) -> int:
    readable_file(args.file)
    quote = _Api(args).submit(
        args.file, model=args.model, defaults=args.defaults, progress=not args.quiet, dry_run=True
    )
    from pagedbatch.job_view import quote_table

    print(json.dumps(quote, indent=2) if args.json else quote_table(quote))
    return EXIT_OK


def _show_submitted(args, job: dict) -> None:
    """After the id: the job as JSON on stdout (--json), or its table on stderr (stdout keeps the id alone)."""
    if args.json:
        print(json.dumps(job, indent=2))
        return
    from pagedbatch.job_view import job_table

    print(job_table(job), file=sys.stderr)


def _status(args) -> int:
    job = _Api(args).job(args.job_id)
    if job.get("status_detail"):  # why it waits (the storage is full, unreachable...)
        print(f"job {job['id']}: {job['status']} ({job['status_detail']})", file=sys.stderr)
    _emit(args, job)
    return EXIT_OK


def _wait(args) -> int:
    job = _Api(args).wait(args.job_id, timeout=args.timeout, progress=not args.quiet)
    _emit(args, job)
    return job_exit_status(job, args.strict)


def _download(args) -> int:
    writable_output(args.output)
    path = _Api(args).download(args.job_id, args.output, fmt=args.format, errors=args.errors, progress=not args.quiet)
    print(path)
    return EXIT_OK


def _jobs(args) -> int:
    page = _Api(args).jobs(limit=args.limit, status=args.status, after=args.after)
    if args.json:
        print(json.dumps(page, indent=2))
        return EXIT_OK
    from pagedbatch.job_view import jobs_table

    print(jobs_table(page["data"]))
    if page.get("has_more"):
        print(f"more: pagedbatch jobs --after {page['data'][-1]['id']}", file=sys.stderr)
    return EXIT_OK


def _cancel(args) -> int:
    _emit(args, _Api(args).cancel(args.job_id))
    return EXIT_OK


def _errors(args) -> int:
    lines = _Api(args).error_lines(args.job_id)
    if args.json:  # the API's JSONL, one object a line
        for line in lines:
            print(json.dumps(line))
        return EXIT_OK
    from pagedbatch.job_view import errors_table

    print(errors_table(list(lines)))
    return EXIT_OK


def _webhooks(args) -> int:
    """Each webhook endpoint, then its latest deliveries: event, status, attempts, last answer."""
    api = _Api(args)
    endpoints = api.webhook_endpoints()
    shown = [{**e, "deliveries": api.webhook_deliveries(e["id"], limit=args.limit)} for e in endpoints]
    if args.json:
        print(json.dumps(shown, indent=2))
        return EXIT_OK
    for endpoint in shown:
        print(f"{endpoint['id']}  {endpoint['name']}  {endpoint['url']}  {','.join(endpoint['event_types'])}")
        for d in endpoint["deliveries"]:
            answer = d["last_status_code"] or d["last_error"] or "-"
            print(f"  {d['event_type']:<16} {d['status']:<9} attempts={d['attempts']}  last={answer}  {d['event_id']}")
    if not shown:
        print("no webhook endpoints")
    return EXIT_OK


def add_commands(commands) -> None:
    def client_parser(name: str, help: str, *, json_help: str = "print the job as JSON", epilog=None):
        parser = commands.add_parser(name, help=help, epilog=epilog)
        parser.add_argument(
            "--url",
            type=api_url,
            default=current(ClientSettings).api_url,
            help=f"the API (default: ${URL_ENV}, else {DEFAULT_API_URL})",
        )
        parser.add_argument(
            "--api-key",
            default=None,
            help="default: $PAGEDBATCH_API_KEY, else the key `serve` saved in $PAGEDBATCH_HOME (local URLs)",
        )
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
        if json_help:
            parser.add_argument("--json", action="store_true", help=json_help)
        return parser

    submit = client_parser(
        "submit",
        "upload a JSONL file as a job; prints the job id",
        epilog=EXIT_STATUS_HELP,
        json_help="print the job as JSON on stdout after its id",
    )
    submit.add_argument("file")
    submit.add_argument("--model", required=True)
    submit.add_argument(
        "--defaults", type=json_object, help="JSON object of default body fields, e.g. '{\"max_tokens\": 64}'"
    )
    submit.add_argument("--metadata", type=json_object, help="JSON object")
    submit.add_argument("--wait", action="store_true", help="wait for the job to finish")
    submit.add_argument("-o", "--output", help="wait, then download the results here")
    submit.add_argument("--strict", action="store_true", help="with --wait: exit 3 when any line failed")
    submit.set_defaults(func=_submit)

    quote = client_parser(
        "quote",
        "plan and price a JSONL file without running it: tokens, cache hits, run time, finish time",
        json_help="print the API's quote as JSON",
    )
    quote.add_argument("file")
    quote.add_argument("--model", required=True)
    quote.add_argument("--defaults", type=json_object, help="JSON object of default body fields")
    quote.set_defaults(func=_quote)

    status = client_parser("status", "print a job: status, progress, line counts")
    status.add_argument("job_id")
    status.set_defaults(func=_status)

    wait = client_parser("wait", "wait for a job to finish, with a progress bar", epilog=EXIT_STATUS_HELP)
    wait.add_argument("job_id")
    wait.add_argument("--timeout", type=float, default=None, help="give up (exit 1) after this many seconds")
    wait.add_argument("--strict", action="store_true", help="exit 3 when any line failed")
    wait.set_defaults(func=_wait)

    download = client_parser("download", "download a job's results (Parquet, or --format jsonl)", json_help="")
    download.add_argument("job_id")
    download.add_argument("-o", "--output", required=True)
    download.add_argument("--format", default="parquet", choices=["parquet", "jsonl"])
    download.add_argument("--errors", action="store_true", help="download the error lines instead")
    download.set_defaults(func=_download)

    jobs = client_parser(
        "jobs",
        "list your jobs, newest first: status, progress, line counts",
        json_help="print the API's list object as JSON",
    )
    jobs.add_argument("--limit", type=int, default=20, help="how many (1 to 100)")
    jobs.add_argument("--status", default=None, help="only jobs with this status")
    jobs.add_argument("--after", default=None, metavar="JOB_ID", help="the page after this job")
    jobs.set_defaults(func=_jobs)

    cancel = client_parser("cancel", "cancel a job; what finished is kept")
    cancel.add_argument("job_id")
    cancel.set_defaults(func=_cancel)

    errors = client_parser(
        "errors",
        "print a job's failed lines (custom_id, code, message)",
        json_help="print the API's error lines (JSONL) instead",
    )
    errors.add_argument("job_id")
    errors.set_defaults(func=_errors)

    webhooks = client_parser(
        "webhooks",
        "list webhook endpoints and their latest deliveries (the delivery log)",
        json_help="print the endpoints with their deliveries as JSON",
    )
    webhooks.add_argument("--limit", type=int, default=10, help="deliveries shown per endpoint (1 to 100)")
    webhooks.set_defaults(func=_webhooks)
