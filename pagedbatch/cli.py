"""`pagedbatch` command line: one module per audience registers its commands here.

Each command imports what it needs when it runs, so that `pagedbatch submit` never loads torch or Flask.
A mistake is one line on stderr and a documented exit status (`pagedbatch.failures`); tracebacks only
with --debug or PAGEDBATCH_DEBUG=1.
"""

from __future__ import annotations

import argparse

from pagedbatch.commands import admin_commands, client_commands, doctor_command, engine_commands, server_commands
from pagedbatch.failures import EXIT_STATUS_HELP, EXIT_USAGE, debug_enabled, report, usage_error
from settings import SettingsError, check_environment


class Parser(argparse.ArgumentParser):
    """argparse with --debug on every command and its errors in one line, not the whole usage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="print tracebacks (also PAGEDBATCH_DEBUG=1)"
        )

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagedbatch", description="Batch inference for LLMs.", epilog=EXIT_STATUS_HELP)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for audience in (engine_commands, server_commands, admin_commands, client_commands, doctor_command):
        audience.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        check_environment()  # every variable of every process kind, before anything reads one
    except SettingsError as exc:
        return report(usage_error(f"bad environment: {exc}"), False)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as exc:  # every failure is one line and a status
        return report(exc, debug_enabled(args))
