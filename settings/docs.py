"""docs/configuration.md, generated from the settings classes: `python -m settings.docs` prints it,
`python -m settings.docs --write` writes it (tests/settings/ checks the committed file is this text)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

from settings import KINDS

PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = """# Configuration

Every environment variable pagedbatch reads, by the process that reads it. Each process checks all of
them when it starts (`pagedbatch ...` stops with `bad environment: ...` and exit status 2, naming the
variable and what it should hold). An empty variable counts as unset.

This file is generated from the classes in `settings/` (`python -m settings.docs --write`); a test keeps
the two in step. Command-line flags, where a command has one, win over these.
"""


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _type(annotation) -> str:
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if args:  # X | None
        return " or ".join(_type(a) for a in args)
    return {bool: "boolean", int: "integer", float: "number", str: "text"}.get(annotation, str(annotation))


def render() -> str:
    parts = [HEADER]
    for kind in KINDS:
        parts.append(f"\n## {kind.__name__}\n\n{kind.__doc__.strip()}\n")
        parts.append("| variable | type | default | meaning |\n| --- | --- | --- | --- |")
        for name, variable in kind.variables().items():
            field = kind.model_fields[name]
            parts.append(f"| `{variable}` | {_type(field.annotation)} | {_default(field)} | {field.description} |")
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        PATH.write_text(render())
    elif argv:
        print("usage: python -m settings.docs [--write]", file=sys.stderr)
        return 2
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
