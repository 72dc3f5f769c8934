"""What the app knows about the platform it serves: its settings, set once by the app factory, and the
pool that validates new jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from flask import Flask, current_app

from api.validations import ValidationPool
from store.settings import Settings

EXTENSION = "pagedbatch"


@dataclass
class Platform:
    settings: Settings
    validations: ValidationPool = field(init=False)

    def __post_init__(self):
        self.validations = ValidationPool(self.settings)


def install(app: Flask, settings: Settings) -> None:
    platform = app.extensions[EXTENSION] = Platform(settings)
    app.before_request(platform.validations.start_resumer)  # in each serving process, after gunicorn forked


def settings() -> Settings:
    """The settings of the app handling this request."""
    return current_app.extensions[EXTENSION].settings


def validate_in_background(job_id: str, owner: str):
    """Hand a new job to this process's validation pool; returns its future."""
    return current_app.extensions[EXTENSION].validations.submit(job_id, owner)
