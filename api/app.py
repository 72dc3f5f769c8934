"""The Flask application factory."""

from __future__ import annotations

from dataclasses import dataclass

from flask import Flask

from api.auth import authenticate
from api.errors import register_error_handlers
from store.settings import Settings


@dataclass
class Platform:
    settings: Settings


def create_app(settings: Settings | None = None, *, warm: bool = True) -> Flask:
    """The WSGI app. `warm` loads the configured models' tokenizers now (before gunicorn forks its
    workers) rather than on the first upload."""
    from api.routes import jobs, meta, openai_batch
    from api.routes.common import UploadRequest

    settings = settings or Settings.from_env()
    if warm and settings.models:
        from batchfile.parsing import model_limits

        model_limits(settings)
    app = Flask("pagedbatch")
    app.request_class = UploadRequest  # multipart uploads are cut off at the limits while they stream
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_bytes + (1 << 20)  # room for multipart framing
    app.config["MAX_FORM_MEMORY_SIZE"] = 1 << 20
    app.json.sort_keys = False
    app.url_map.merge_slashes = False  # "/v1/jobs//x" is a 404 error object, not an HTML redirect
    app.extensions["pagedbatch"] = Platform(settings)
    register_error_handlers(app)
    app.before_request(authenticate)  # every route but /healthz and /openapi.json needs an API key
    app.register_blueprint(meta.bp)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(openai_batch.bp)
    return app
