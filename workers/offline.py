"""The offline path: an OpenAI-batch JSONL file in, one Parquet results file out, no services.

`run_offline` parses the file with `batchfile.parser`, feeds every valid request into one
in-process engine through its step API (a bounded number in flight, so a large file is never all
in the engine at once), and writes one row per line with the `store.results` schema, bad lines
included as failed rows. A file in which no line is a request is refused (`NoRequests`) before
the engine loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from batchfile.errors import LineError
from batchfile.lines import count_lines
from batchfile.model_limits import ModelLimits
from batchfile.parser import parse_requests
from batchfile.request import ParsedRequest
from engine.runner.gc_heap import frozen_heap
from store.results.parquet import count_table, write_results
from store.results.rows import error_row, request_failed_row, rows_to_table
from workers.host import lora_adapters
from workers.line_requests import add_to_engine, result_row
from workers.progress_bar import RequestBar


class NoRequests(ValueError):
    """No line of the input is a request: there is nothing to run."""


@dataclass
class OfflineSummary:
    output_path: str
    total: int
    completed: int
    failed: int
    cancelled: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float


def run_offline(
    input_path,
    output_path,
    model_path,
    *,
    progress: bool = True,
    engine_kwargs: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
    model_name: str | None = None,
    max_in_flight: int = 1024,
    llm=None,
    loras: dict[str, str] | None = None,
) -> OfflineSummary:
    """Run every request of `input_path` (OpenAI batch JSONL) on the model at `model_path`.

    Every line runs on this model whatever its body.model says; responses name the model
    `model_name` (default: the model directory's name). `engine_kwargs` go to
    ``engine.LLM(model=model_path, ...)``; pass `llm` to reuse an engine already loaded.
    `defaults`: body fields for lines that lack them (e.g. ``{"max_tokens": 256}``).
    `output_path`: a local path or an fsspec URL; written atomically when everything is done.
    `loras`: LoRA adapters ({name: directory}; the engine needs enable_lora): a line whose body.model names
    one runs with it, a line with no body.model on the model itself, any other name is a line error.
    """
    started = time.time()
    check_has_requests(input_path, model_path, defaults=defaults, model_name=model_name)
    if llm is None:
        from engine import LLM

        llm = LLM(model=str(model_path), **(engine_kwargs or {}))
    engine = llm.llm_engine
    limits = _limits(engine, model_path, model_name)
    models = limits
    lora_adapters.configure(loras or {})
    if loras:  # lines name the model or an adapter; those naming none run on the model
        models = {limits.name: limits, **{n: replace(limits, name=n, base_model=limits.name) for n in loras}}
        defaults = {"model": limits.name, **(defaults or {})}
    with open(input_path, "rb") as f:
        total = count_lines(f).lines
    bar = _progress_bar(total, progress)
    with frozen_heap():  # the engine's and the caller's objects are not walked by every full collection
        try:
            with open(input_path, "rb") as f:
                rows = _drive(engine, parse_requests(f, models, defaults=defaults), limits, started, bar, max_in_flight)
        finally:
            bar.close()
        table = rows_to_table(rows)
        path = write_results(str(output_path), table)
    counts = count_table(table)
    return OfflineSummary(
        output_path=path,
        total=counts.total,
        completed=counts.completed,
        failed=counts.failed,
        cancelled=counts.cancelled,
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        elapsed_s=time.time() - started,
    )


def check_has_requests(input_path, model_path, *, defaults=None, model_name: str | None = None) -> None:
    """Raise `NoRequests` unless some line of the file is a valid request (read up to the first one,
    with the model's tokenizer only)."""
    limits = ModelLimits.from_dir(model_path, name=model_name or Path(model_path).resolve().name)
    first: LineError | None = None
    with open(input_path, "rb") as f:
        items = parse_requests(f, limits, defaults=defaults, chunk_size=16)
        try:
            for item in items:
                if not isinstance(item, LineError):
                    return
                first = first or item
        finally:
            items.close()
    with open(input_path, "rb") as f:
        lines = count_lines(f).lines
    if first is None:
        raise NoRequests(f"{input_path} has no lines: nothing to run")
    raise NoRequests(
        f"{input_path}: none of its {lines} lines is a request (line {first.line}: {first.code}: {first.message})"
    )


def _limits(engine, model_path, model_name: str | None) -> ModelLimits:
    """The model's limits, with the context capped where the engine was configured shorter."""
    limits = ModelLimits.from_dir(model_path, name=model_name or Path(model_path).resolve().name)
    if engine.max_model_len < limits.max_model_len:
        limits = ModelLimits.from_dir(model_path, name=limits.name, max_model_len=engine.max_model_len)
    return limits


def _drive(engine, items, limits: ModelLimits, started: float, bar, max_in_flight: int) -> list[dict]:
    """Feed the parsed lines into the engine, at most `max_in_flight` at once; one row per line."""
    rows: list[dict] = []
    in_flight: dict[str, tuple[ParsedRequest, float]] = {}

    def finish(outputs) -> None:
        now = time.time()
        for out in outputs:
            if not out.finished or out.request_id not in in_flight:
                continue
            request, submitted = in_flight.pop(out.request_id)
            rows.append(
                result_row(request, out, tokenizer=limits, created_at=started, started_at=submitted, finished_at=now)
            )
            completions = out.outputs if isinstance(out.outputs, list) else ()  # a pooling output has one vector
            bar.update(1, tokens=sum(len(c.token_ids) for c in completions))

    try:
        for item in items:
            if isinstance(item, LineError):
                rows.append(error_row(item, created_at=started, finished_at=time.time()))
                bar.update(1)
                continue
            request_id = str(item.line)
            try:
                add_to_engine(engine, request_id, item)
            except ValueError as e:  # the engine's own limits (e.g. its KV pool) refuse it
                rows.append(_failed(item, getattr(e, "code", "engine_rejected"), str(e), started))
                bar.update(1)
                continue
            in_flight[request_id] = (item, time.time())
            while len(in_flight) >= max_in_flight:
                finish(engine.step())
        while in_flight and engine.has_unfinished_requests():
            finish(engine.step())
    except BaseException:
        for request_id in in_flight:
            engine.abort_request(request_id)
        raise
    for request, _ in in_flight.values():  # the engine lost them: never expected
        rows.append(_failed(request, "engine_error", "the engine finished without this request", started))
    return rows


def _failed(request: ParsedRequest, code: str, message: str, started: float) -> dict:
    return request_failed_row(request, code, message, created_at=started, finished_at=time.time())


def _progress_bar(total: int, enabled: bool) -> RequestBar:
    return RequestBar(total, enabled)
