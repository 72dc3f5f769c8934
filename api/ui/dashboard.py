"""The `/ui` dashboard: server-rendered pages where a tenant signs in with an API key. The session is a
signed cookie (HttpOnly, SameSite=Strict, path /ui) and every form carries a CSRF token (`api.ui.session`)."""

from __future__ import annotations

import secrets
from datetime import timedelta

from flask import Flask

from api.routes import ui, ui_actions
from settings import ApiSettings, current


def install(app: Flask) -> None:
    """Session settings and the UI's routes. PAGEDBATCH_SECRET_KEY signs the session cookie: set it when
    several API hosts serve one dashboard (without it each process draws its own, before gunicorn forks)."""
    app.secret_key = current(ApiSettings).secret_key or secrets.token_hex(32)
    app.config.update(
        SESSION_COOKIE_NAME="pagedbatch_ui",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        SESSION_COOKIE_SECURE=current(ApiSettings).ui_secure_cookie,
        SESSION_COOKIE_PATH="/ui",
        PERMANENT_SESSION_LIFETIME=timedelta(hours=current(ApiSettings).ui_session_hours),
    )
    app.register_blueprint(ui.bp)
    app.register_blueprint(ui_actions.bp)
