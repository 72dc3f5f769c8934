"""Jobs as a person reads them: aligned tables (the client commands print JSON instead with --json)."""

from __future__ import annotations

import time


def _when(seconds) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


def failed_lines(job: dict) -> int:
    """Lines that did not complete: invalid at validation, or failed running (results, not job failures)."""
    counts = job["request_counts"]
    return counts["invalid"] + counts["failed"]


def progress(job: dict) -> str:
    counts = job["request_counts"]
    return f"{job['progress']:.0%} of {counts['valid']}"


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def job_table(job: dict) -> str:
    counts, usage = job["request_counts"], job["usage"]
    rows = [
        ("id", job["id"]),
        ("status", job["status"]),
        ("model", job.get("model") or "-"),
        ("progress", progress(job)),
        (
            "lines",
            f"{counts['total']} total: {counts['completed']} completed, {failed_lines(job)} failed "
            f"({counts['invalid']} invalid, {counts['failed']} failed running), {counts['cancelled']} cancelled",
        ),
        ("tokens", f"{usage['prompt_tokens']} prompt, {usage['completion_tokens']} completion"),
        ("created", _when(job.get("created_at"))),
    ]
    plan = job.get("plan")
    if plan and plan["prompt_tokens"]:
        rows.append(
            (
                "prefix cache",
                f"{plan['cached_tokens']} prompt tokens served, {plan['expected_cached_tokens']} planned "
                f"(of {plan['prompt_tokens']})",
            )
        )
    if job.get("estimated_completion_at"):
        risk = " (misses its completion window)" if job.get("deadline_at_risk") else ""
        rows.append(("estimated end", _when(job["estimated_completion_at"]) + risk))
    for key in ("completed_at", "failed_at", "expired_at", "cancelled_at"):
        if job.get(key):
            rows.append((key.removesuffix("_at"), _when(job[key])))
    for error in (job.get("errors") or [])[:3]:
        rows.append(("error", f"line {error.get('line')}: {error['code']}: {error['message']}"))
    return table(rows)


def _duration(seconds) -> str:
    if seconds is None:
        return "unknown (no worker of the model has measured its rates yet)"
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def quote_table(quote: dict) -> str:
    cached = quote["expected_cached_tokens"]
    share = f" ({cached / quote['prompt_tokens']:.0%})" if quote["prompt_tokens"] else ""
    return table(
        [
            ("model", quote["model"]),
            ("lines", f"{quote['lines']} valid, {quote['invalid_lines']} invalid, in {quote['shards']} shards"),
            ("prompt tokens", f"{quote['prompt_tokens']}, {cached} expected from the prefix cache{share}"),
            ("completion tokens", f"at most {quote['max_completion_tokens']}"),
            ("workers", str(quote["workers"])),
            ("queue ahead", _duration(quote["queue_ahead_seconds"])),
            ("run time", _duration(quote["estimated_run_seconds"])),
            ("finish", _when(quote.get("estimated_completion_at"))),
        ]
    )


def jobs_table(jobs: list[dict]) -> str:
    if not jobs:
        return "no jobs"
    rows = [("ID", "STATUS", "MODEL", "PROGRESS", "LINES", "COMPLETED", "FAILED", "CREATED")]
    for job in jobs:
        counts = job["request_counts"]
        rows.append(
            (
                job["id"],
                job["status"],
                job.get("model") or "-",
                f"{job['progress']:.0%}",
                str(counts["total"]),
                str(counts["completed"]),
                str(failed_lines(job)),
                _when(job.get("created_at")),
            )
        )
    return table(rows)


def error_row(line: dict) -> tuple[str, str, str]:
    """(custom_id, code, message) of one OpenAI batch error line."""
    error = line.get("error") or ((line.get("response") or {}).get("body") or {}).get("error") or {}
    message = " ".join(str(error.get("message", "")).split())
    return str(line.get("custom_id")), str(error.get("code") or "-"), message[:200]


def errors_table(lines: list[dict]) -> str:
    if not lines:
        return "no failed lines"
    return table([("CUSTOM_ID", "CODE", "MESSAGE"), *(error_row(line) for line in lines)])
