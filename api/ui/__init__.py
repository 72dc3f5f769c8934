"""The `/ui` dashboard's templates (`templates/`, inline CSS and JS, no build step, nothing from a CDN) and
its session (`session`). `api.ui.dashboard` installs it; the routes are `api.routes.ui` and `api.routes.ui_actions`."""

from __future__ import annotations

import os

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")
