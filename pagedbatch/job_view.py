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
        ("lines", f"{counts['total']} total: {counts['completed']} completed, {failed_lines(job)} failed "
                  f"({counts['invalid']} invalid, {counts['failed']} failed running), {counts['cancelled']} cancelled"),
        ("tokens", f"{usage['prompt_tokens']} prompt, {usage['completion_tokens']} completion"),
        ("created", _when(job.get("created_at"))),
    ]  # fmt: skip
    for key in ("completed_at", "failed_at", "expired_at", "cancelled_at"):
        if job.get(key):
            rows.append((key.removesuffix("_at"), _when(job[key])))
    for error in (job.get("errors") or [])[:3]:
        rows.append(("error", f"line {error.get('line')}: {error['code']}: {error['message']}"))
    return table(rows)


def jobs_table(jobs: list[dict]) -> str:
    if not jobs:
        return "no jobs"
    rows = [("ID", "STATUS", "MODEL", "PROGRESS", "LINES", "COMPLETED", "FAILED", "CREATED")]
    for job in jobs:
        counts = job["request_counts"]
        rows.append((job["id"], job["status"], job.get("model") or "-", f"{job['progress']:.0%}", str(counts["total"]),
                     str(counts["completed"]), str(failed_lines(job)), _when(job.get("created_at"))))
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
