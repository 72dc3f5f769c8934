"""`pagedbatch` command line: one module per audience registers its commands here.

Each command imports what it needs when it runs, so that `pagedbatch submit` never loads torch or Flask.
"""

from __future__ import annotations

import argparse

from pagedbatch import admin_commands, client_commands, engine_commands, server_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbatch", description="Batch inference for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    for audience in (engine_commands, server_commands, admin_commands, client_commands):
        audience.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
