"""The `/ui` dashboard: server-rendered pages where a tenant signs in with an API key. The session is a
signed cookie (HttpOnly, SameSite=Strict, path /ui) and every form carries a CSRF token (`api.ui.session`)."""

from __future__ import annotations

import os
import secrets
from datetime import timedelta

from flask import Flask

from api.routes import ui, ui_actions


def install(app: Flask) -> None:
    """Session settings and the UI's routes. PAGEDBATCH_SECRET_KEY signs the session cookie: set it when
    several API hosts serve one dashboard (without it each process draws its own, before gunicorn forks)."""
    app.secret_key = os.environ.get("PAGEDBATCH_SECRET_KEY") or secrets.token_hex(32)
    app.config.update(
        SESSION_COOKIE_NAME="pagedbatch_ui",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_SECURE=os.environ.get("PAGEDBATCH_UI_SECURE_COOKIE", "") not in ("", "0", "false"),
        SESSION_COOKIE_PATH="/ui",
        PERMANENT_SESSION_LIFETIME=timedelta(hours=int(os.environ.get("PAGEDBATCH_UI_SESSION_HOURS") or 12)),
    )
    app.register_blueprint(ui.bp)
    app.register_blueprint(ui_actions.bp)
