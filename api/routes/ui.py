"""The dashboard's pages: sign-in, the tenant's jobs (polling `/ui/jobs.json`) and the admin view."""

from __future__ import annotations

import secrets

from flask import Blueprint, abort, flash, g, jsonify, redirect, render_template, request, url_for

from api.platform import settings
from api.serializers import job_object
from api.ui import TEMPLATES
from api.ui.session import check_csrf, csrf_token, load_user, sign_in, sign_out
from broker.queue import queue_size
from store import models_registry, stats, throughput
from store.lifecycle import jobs
from store.lifecycle.progress import job_progress

bp = Blueprint("ui", __name__, url_prefix="/ui", template_folder=TEMPLATES)
OPEN_ENDPOINTS = ("ui.login", "ui.login_form")
JOBS_SHOWN = 50
CHART_MINUTES = 30


@bp.before_request
def _require_user():
    if load_user() is None and request.endpoint not in OPEN_ENDPOINTS:
        if request.endpoint == "ui.jobs_json":
            abort(401, description="sign in at /ui/login")
        return redirect(url_for("ui.login_form"))
    return None


@bp.after_request
def _headers(response):
    """No framing, no inline script but the page's own (its nonce), nothing loaded from elsewhere."""
    nonce = g.get("csp_nonce", "")
    response.headers["Content-Security-Policy"] = (
        f"default-src 'self'; script-src 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'"
    )
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.app_context_processor
def _template_globals():
    if request.blueprint not in ("ui", "ui_actions"):
        return {}
    g.csp_nonce = g.get("csp_nonce") or secrets.token_urlsafe(16)
    return {"csrf_token": csrf_token, "csp_nonce": g.csp_nonce}


@bp.get("/login")
def login_form():
    return render_template("login.html")


@bp.post("/login")
def login():
    check_csrf()
    if sign_in(request.form.get("api_key", "")) is None:
        flash("That API key is not valid (unknown or revoked).", "error")
        return render_template("login.html"), 401
    return redirect(url_for("ui.index"))


@bp.post("/logout")
def logout():
    check_csrf()
    sign_out()
    return redirect(url_for("ui.login_form"))


def _jobs_payload() -> dict:
    cfg = settings()
    found, _ = jobs.list_jobs(cfg, g.tenant, limit=JOBS_SHOWN)
    rows = [job_object(job, job_progress(cfg, job)).model_dump(mode="json") for job in found]
    series = throughput.tokens_per_minute(cfg, g.tenant, CHART_MINUTES)
    return {
        "tenant": g.tenant,
        "jobs": rows,
        "throughput": [
            {
                "t": int(m.start.timestamp()),
                "prompt_tokens": m.prompt_tokens,
                "completion_tokens": m.completion_tokens,
                "requests": m.requests,
            }
            for m in series
        ],
    }


@bp.get("/")
def index():
    models = sorted(models_registry.model_paths(settings()))
    return render_template("jobs.html", data=_jobs_payload(), models=models)


@bp.get("/jobs.json")
def jobs_json():
    return jsonify(_jobs_payload())


def _queue_depth(model: str) -> int | None:
    try:
        return queue_size(settings(), model)
    except Exception:  # the page still shows the rest when Redis is down
        return None


@bp.get("/admin")
def admin():
    if not g.is_admin:
        abort(403, description="the admin view needs an admin tenant's key (PAGEDBATCH_ADMIN_TENANTS)")
    cfg = settings()
    workers = models_registry.running_workers(cfg)
    models = sorted(set(models_registry.model_paths(cfg)))
    queues = [(m, cfg.queue_for(m), _queue_depth(m), sum(w.model == m for w in workers)) for m in models]
    return render_template(
        "admin.html",
        workers=workers,
        queues=queues,
        by_status=stats.jobs_by_status(cfg),
        running=models_registry.running_models(cfg),
    )
