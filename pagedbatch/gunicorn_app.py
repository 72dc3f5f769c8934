"""The API as a gunicorn application, for `pagedbatch api`, with its Prometheus multiprocess directory."""

from __future__ import annotations

import tempfile
from pathlib import Path

from gunicorn.app.base import BaseApplication

from settings import ApiSettings, current, export

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


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


def prepare_metrics_dir() -> str:
    """Point prometheus_client at a directory shared by the gunicorn workers (PROMETHEUS_MULTIPROC_DIR,
    or a new temporary one), emptied of a previous run's files. Call before prometheus_client is imported."""
    path = Path(current(ApiSettings).prometheus_multiproc_dir or tempfile.mkdtemp(prefix="pagedbatch-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    export(MULTIPROC_ENV, str(path))
    return str(path)


def child_exit(_server, worker) -> None:
    """gunicorn hook: a dead worker's live gauges leave the metrics (its counters stay summed)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)
