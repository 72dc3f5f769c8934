"""Reading a JSONL input line by line under size limits, and counting its lines cheaply."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from batchfile.errors import InputTooLarge

DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
_BOM = b"\xef\xbb\xbf"


def read_lines(
    stream: IO[bytes],
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_lines: int | None = None,
    max_bytes: int | None = None,
) -> Iterator[tuple[int, bytes | None]]:
    """Yield (line number, content) for non-blank lines; content None when over `max_line_bytes`.

    Never holds more than one line. Raises `InputTooLarge` past `max_lines` non-blank lines or
    `max_bytes` bytes.
    """
    number, total, count = 0, 0, 0

    def account(size: int) -> None:
        nonlocal total
        total += size
        if max_bytes is not None and total > max_bytes:
            raise InputTooLarge("bytes", max_bytes, total)

    while True:
        raw = stream.readline(max_line_bytes + 2)  # content, maybe "\r", and "\n"
        if not raw:
            return
        number += 1
        account(len(raw))
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        too_long = False
        if not raw.endswith(b"\n") and len(raw) == max_line_bytes + 2:
            too_long = True
            while True:  # skip the rest of the line without holding it
                rest = stream.readline(1 << 20)
                account(len(rest))
                if not rest or rest.endswith(b"\n"):
                    break
        content = raw.rstrip(b"\r\n")
        too_long = too_long or len(content) > max_line_bytes
        if not too_long and not content.strip():
            continue
        count += 1
        if max_lines is not None and count > max_lines:
            raise InputTooLarge("lines", max_lines, count)
        yield number, None if too_long else content


class LineCounter:
    """Non-blank lines of a stream fed chunk by chunk (blank lines do not count towards a limit), and
    whether it uses CR-only line endings (carriage returns and no line feed at all), which would
    otherwise read as one giant line."""

    def __init__(self):
        self.lines = 0
        self.bare_cr = False  # a carriage return not followed by a line feed
        self.line_feeds = False
        self._pending = False  # the current, unfinished line has non-blank content
        self._ends_with_cr = False

    def feed(self, chunk: bytes) -> int:
        """Count the chunk; returns the non-blank lines so far (the unfinished last one not included)."""
        if not chunk:
            return self.lines
        if self._ends_with_cr and not chunk.startswith(b"\n"):
            self.bare_cr = True
        crs = chunk.count(b"\r")
        if crs and crs != chunk.count(b"\r\n") + chunk.endswith(b"\r"):
            self.bare_cr = True
        self._ends_with_cr = chunk.endswith(b"\r")
        self.line_feeds = self.line_feeds or b"\n" in chunk
        *complete, last = chunk.split(b"\n")
        for piece in complete:
            if self._pending or piece.strip():
                self.lines += 1
            self._pending = False
        self._pending = self._pending or bool(last.strip())
        return self.lines

    def finish(self) -> int:
        """All non-blank lines, the last one counted even without a line break."""
        if self._ends_with_cr:
            self.bare_cr = True
        if self._pending:
            self.lines += 1
            self._pending = False
        return self.lines

    @property
    def cr_only(self) -> bool:
        """Content split by carriage returns alone (call after `finish`). A stray CR in a file with line
        feeds is left to the line it is in (JSON whitespace there, or that line's error)."""
        return self.bare_cr and not self.line_feeds and self.lines > 0


@dataclass
class LineCount:
    lines: int  # non-blank lines
    bytes: int


def count_lines(stream: IO[bytes], *, max_lines: int | None = None, max_bytes: int | None = None) -> LineCount:
    """Count non-blank lines and bytes in one cheap pass, raising `InputTooLarge` over a limit."""
    counter = LineCounter()
    total = 0
    while chunk := stream.read(1 << 20):
        if total == 0 and chunk.startswith(_BOM):
            chunk = chunk[len(_BOM) :]
            total += len(_BOM)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise InputTooLarge("bytes", max_bytes, total)
        if counter.feed(chunk) > (max_lines if max_lines is not None else counter.lines):
            raise InputTooLarge("lines", max_lines, counter.lines)
    lines = counter.finish()
    if max_lines is not None and lines > max_lines:
        raise InputTooLarge("lines", max_lines, lines)
    return LineCount(lines, total)
