"""The dashboard's actions: submit a JSONL job, cancel a job, download its results. Each reuses the API's
own route code with the signed-in tenant, so the limits, validation and errors are the API's."""

from __future__ import annotations

from flask import Blueprint, abort, flash, redirect, request, url_for

from api.routes import jobs as job_routes
from api.ui.session import check_csrf, load_user
from store.errors import StoreError

bp = Blueprint("ui_actions", __name__, url_prefix="/ui")
DOWNLOADS = ("jsonl", "parquet", "errors")


@bp.before_request
def _require_user():
    if load_user() is None:
        abort(401, description="sign in at /ui/login")
    if request.method == "POST":
        check_csrf()


@bp.post("/jobs")
def submit():
    if not request.form.get("model"):
        flash("Choose a model.", "error")
        return redirect(url_for("ui.index"))
    try:
        response, _ = job_routes.create_job()
    except StoreError as exc:
        flash(f"Not submitted: {exc.message}", "error")
        return redirect(url_for("ui.index"))
    job = response.get_json()  # validating: the jobs table shows the line errors once it is validated
    flash(f"Submitted {job['id']}: validating.", "info")
    return redirect(url_for("ui.index"))


@bp.post("/jobs/<job_id>/cancel")
def cancel(job_id: str):
    try:
        job_routes.cancel_job(job_id)
        flash(f"Cancelling {job_id}.", "info")
    except StoreError as exc:
        flash(f"Could not cancel {job_id}: {exc.message}", "error")
    return redirect(url_for("ui.index"))


@bp.get("/jobs/<job_id>/download/<kind>")
def download(job_id: str, kind: str):
    """The job's output (?kind: jsonl or parquet) or its error lines, as an attachment."""
    if kind not in DOWNLOADS:
        abort(404)
    if kind == "errors":
        return job_routes.get_errors(job_id)
    request.args = request.args.copy()
    request.args["format"] = kind
    return job_routes.get_results(job_id)
