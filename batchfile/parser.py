"""`parse_requests`: a JSONL input in, one `ParsedRequest` or `LineError` per non-blank line out,
in line order."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

from batchfile import prompts
from batchfile.errors import InvalidLine, LineError
from batchfile.lines import DEFAULT_MAX_LINE_BYTES, read_lines
from batchfile.model_limits import ModelLimits
from batchfile.request import ParsedRequest
from batchfile.sampling import OPENAI_BOUNDS, RequestBounds
from batchfile.validation import LineValidator, Pending, finish


def parse_requests(
    stream: IO[bytes],
    models: ModelLimits | Mapping[str, ModelLimits],
    *,
    defaults: Mapping[str, Any] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_lines: int | None = None,
    max_bytes: int | None = None,
    chunk_size: int = 256,
    bounds: RequestBounds = OPENAI_BOUNDS,
    strict_model: bool = False,
) -> Iterator[ParsedRequest | LineError]:
    """Yield a ParsedRequest or a LineError per non-blank line of `stream`, in line order.

    `models`: the known models by name (body.model must name one), or one `ModelLimits` that
    serves every line whatever its body.model says (the offline path), or with `strict_model` the lines
    whose body.model is absent or names it (the native API). `defaults`: job-level body
    fields (OpenAI names, e.g. ``{"max_tokens": 256}``) that a line's own fields override. `bounds`:
    what one request may ask for (stop strings, output budget).
    Raises only `InputTooLarge` (past `max_lines` non-blank lines or `max_bytes` bytes).

    Lines are handled in chunks of `chunk_size`: while one chunk is tokenized in a helper thread,
    the next one is parsed, so at most three chunks are held at a time.
    """
    validator = LineValidator(models, defaults, bounds, strict_model)
    lines = read_lines(stream, max_line_bytes, max_lines, max_bytes)
    checked = (validator.check_line(number, content, max_line_bytes) for number, content in lines)
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    inflight: collections.deque[_Chunk] = collections.deque()
    try:
        for items in _batches(checked, chunk_size):
            inflight.append(_Chunk.start(items, pool))
            if len(inflight) > 1:
                yield from inflight.popleft().results()
        while inflight:
            yield from inflight.popleft().results()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class _Chunk:
    """Checked lines whose prompts are rendered, and tokenized in the pool."""

    items: list[Pending | LineError]
    errors: dict[int, LineError]  # by line: rendering or tokenizing failed
    tokenized: Future | None

    @classmethod
    def start(cls, items: list[Pending | LineError], pool: ThreadPoolExecutor) -> _Chunk:
        errors: dict[int, LineError] = {}
        pending = [p for p in items if isinstance(p, Pending)]
        prompts.render(pending, errors)
        prompts.screen_long(pending, errors)
        groups = prompts.to_encode(pending, errors)
        return cls(items, errors, pool.submit(prompts.encode, groups, errors) if groups else None)

    def results(self) -> Iterator[ParsedRequest | LineError]:
        if self.tokenized is not None:
            self.tokenized.result()
        for item in self.items:
            if isinstance(item, LineError):
                yield item
            elif item.line in self.errors:
                yield self.errors[item.line]
            else:
                try:
                    yield finish(item)
                except InvalidLine as e:
                    yield LineError(item.line, item.custom_id, e.code, e.message, e.param)


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
