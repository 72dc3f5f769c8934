"""The Flask application factory."""

from __future__ import annotations

from flask import Flask

from api import log_context, metrics, platform, request_ids
from api.auth import authenticate
from api.errors import register_error_handlers
from api.routes import jobs, meta, openai_batch, openai_uploads, webhooks
from api.routes.uploads import FRAMING_ROOM, UploadRequest
from api.ui import dashboard
from batchfile.model_limits import limits_by_name
from store.settings import Settings


def create_app(settings: Settings | None = None, *, warm: bool = True) -> Flask:
    """The WSGI app. `warm` loads the configured models' tokenizers now (before gunicorn forks its
    workers) rather than on the first upload."""
    settings = settings or Settings.from_env()
    if warm and settings.models:
        limits_by_name(settings.models, settings.special_tokens_in_content)
    app = Flask("pagedbatch")
    app.request_class = UploadRequest  # multipart uploads are cut off at the limits while they stream
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_bytes + FRAMING_ROOM
    app.config["MAX_FORM_MEMORY_SIZE"] = 1 << 20
    app.json.sort_keys = False
    app.url_map.merge_slashes = False  # "/v1/jobs//x" is a 404 error object, not an HTML redirect
    platform.install(app, settings)
    register_error_handlers(app)
    metrics.install(app)  # /metrics, and every request timed and counted
    request_ids.install(app)  # x-request-id on every response
    app.before_request(authenticate)  # every route but /healthz, /readyz, /openapi.json and /metrics needs an API key
    log_context.install(app)  # log lines carry the tenant and job id
    app.register_blueprint(meta.bp)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(openai_batch.bp)
    app.register_blueprint(openai_uploads.bp)
    app.register_blueprint(webhooks.bp)
    dashboard.install(app)  # /ui: the dashboard (session cookie, not the API key header)
    return app
