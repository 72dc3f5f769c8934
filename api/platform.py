"""What the app knows about the platform it serves: its settings, set once by the app factory."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from flask import Flask, current_app

from api.errors import ApiError
from store.settings import Settings

EXTENSION = "pagedbatch"


@dataclass
class Platform:
    settings: Settings
    validations: threading.Semaphore = field(init=False)

    def __post_init__(self):
        self.validations = threading.BoundedSemaphore(max(self.settings.max_concurrent_validations, 1))


def install(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = Platform(settings)


class ServerBusy(ApiError):
    def __init__(self):
        super().__init__(503, "too many uploads are being validated; retry shortly", code="server_busy")
        self.headers = {"Retry-After": "5"}


@contextlib.contextmanager
def validation_slot() -> Iterator[None]:
    """One of the process's `max_concurrent_validations` slots for validating an upload (parsing and
    tokenizing take memory and CPU, so only so many run at once); a 503 after `validation_wait_s`."""
    platform = current_app.extensions[EXTENSION]
    if not platform.validations.acquire(timeout=platform.settings.validation_wait_s):
        raise ServerBusy
    try:
        yield
    finally:
        platform.validations.release()


def settings() -> Settings:
    """The settings of the app handling this request."""
    return current_app.extensions[EXTENSION].settings
