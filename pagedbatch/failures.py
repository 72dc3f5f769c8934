"""How the command line fails: one short line on stderr and an exit status a script can trust.

Exit statuses (the same for `run`, `wait` and `submit --wait`):
  0  done; the job completed (lines that failed are results, counted in the summary)
  1  anything else: the API or database cannot be reached, a server error, an internal error
  2  usage and input errors: bad arguments, a missing or unreadable file, an output path that cannot be
     written, a file with no request line, a job id the API does not know, a request the API refuses
  3  with --strict: the job completed but some lines failed
  4  the job failed, expired or was cancelled
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from settings import ClientSettings, SettingsError, current

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_LINES_FAILED, EXIT_JOB_FAILED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a SIGINT
DEBUG_ENV = "PAGEDBATCH_DEBUG"
EXIT_STATUS_HELP = (
    "exit status: 0 done (the job completed; failed lines are results, counted in the summary), "
    "1 any other error (the API or database unreachable, a server or internal error), "
    "2 usage or input error (bad arguments, missing file, unwritable output, no request line, unknown job), "
    "3 with --strict: completed but some lines failed, 4 the job failed, expired or was cancelled. "
    f"130 interrupted. --debug (or {DEBUG_ENV}=1) shows tracebacks."
)


class CliError(Exception):
    """A mistake the command explains in one line; `status` is the exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR):
        super().__init__(message)
        self.status = status


def usage_error(message: str) -> CliError:
    return CliError(message, EXIT_USAGE)


def one_line(text: object, limit: int = 300) -> str:
    """The first line of `text`, cut to `limit` characters."""
    lines = str(text).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def debug_enabled(args) -> bool:
    if getattr(args, "debug", False):
        return True
    try:
        return current(ClientSettings).debug
    except SettingsError:  # reported as the command's error
        return False


def os_error(exc: OSError) -> CliError:
    """A file the user named that cannot be read or written, as one line."""
    name = exc.filename if exc.filename is not None else ""
    if isinstance(exc, FileNotFoundError):
        return usage_error(f"no such file or directory: {name}")
    if isinstance(exc, IsADirectoryError):
        return usage_error(f"{name} is a directory")
    if isinstance(exc, NotADirectoryError):
        return usage_error(f"not a directory: {name}")
    if isinstance(exc, PermissionError):
        return usage_error(f"permission denied: {name}")
    reason = exc.strerror or one_line(exc)
    return CliError(f"{name}: {reason}" if name else reason)


@contextlib.contextmanager
def database_errors(url: Callable[[], str]):
    """A database URL that is not one (exit 2) or a database that cannot be reached (exit 1), as one line."""
    from sqlalchemy.exc import ArgumentError, OperationalError

    try:
        yield
    except ArgumentError as exc:
        raise usage_error(f"not a database URL: {one_line(exc)}") from exc
    except OperationalError as exc:
        raise CliError(f"cannot reach the database at {masked(url())}: {one_line(exc.orig or exc)}") from exc


def report(exc: BaseException, debug: bool) -> int:
    """Say what went wrong on stderr (one line; the traceback too with --debug); the exit status."""
    if debug:
        traceback.print_exception(exc)
    if isinstance(exc, KeyboardInterrupt):
        print("pagedbatch: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError) and exc.filename is not None:
        exc = os_error(exc)
    if isinstance(exc, CliError):
        print(f"pagedbatch: {one_line(exc, 400)}", file=sys.stderr)
        return exc.status
    where = "" if debug else f" (traceback in {_save_traceback(exc)}; --debug prints it)"
    print(f"pagedbatch: internal error: {type(exc).__name__}: {one_line(exc)}{where}", file=sys.stderr)
    return EXIT_ERROR


def _save_traceback(exc: BaseException) -> str:
    """The last internal error's traceback, in one file that each error replaces (so it never grows)."""
    text = "".join(traceback.format_exception(exc))
    from store.settings import home_dir

    for folder in (home_dir(), Path(tempfile.gettempdir())):
        path = folder / "last-cli-error.txt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return str(path)
        except OSError:
            continue
    return "nowhere: no writable directory"


def masked(url: str) -> str:
    """The URL without its password, to be shown."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))
