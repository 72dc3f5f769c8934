"""The API as a gunicorn application, for `pagedbatch api`."""

from __future__ import annotations

from gunicorn.app.base import BaseApplication


class GunicornApp(BaseApplication):
    """Runs `app` with the given gunicorn settings (bind, workers, threads, ...), not gunicorn's command line."""

    def __init__(self, app, options: dict):
        self.app = app
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        return self.app
