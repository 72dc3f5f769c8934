"""Each request's log lines carry its tenant, and its job id on the routes of one job or batch (store.logs)."""

from __future__ import annotations

from flask import Flask, g, request

from store.logs import log_context

JOB_ARGS = ("job_id", "batch_id")  # a batch id is its job's id


def _enter() -> None:
    job_id = next((request.view_args[name] for name in JOB_ARGS if name in (request.view_args or {})), None)
    context = log_context(tenant=g.get("tenant"), job_id=job_id)
    context.__enter__()
    g.log_context = context


def _leave(_exc) -> None:
    context = g.pop("log_context", None)
    if context is not None:
        context.__exit__(None, None, None)


def install(app: Flask) -> None:
    """Registered after `authenticate`, so the tenant is known."""
    app.before_request(_enter)
    app.teardown_request(_leave)
