"""Who is calling. Until API keys exist every caller is the default tenant."""

from __future__ import annotations

from flask import current_app


def current_tenant() -> str:
    return current_app.extensions["pagedbatch"].settings.default_tenant
