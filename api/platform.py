"""What the app knows about the platform it serves: its settings, set once by the app factory."""

from __future__ import annotations

from dataclasses import dataclass

from flask import Flask, current_app

from store.settings import Settings

EXTENSION = "pagedbatch"


@dataclass
class Platform:
    settings: Settings


def install(app: Flask, settings: Settings) -> None:
    app.extensions[EXTENSION] = Platform(settings)


def settings() -> Settings:
    """The settings of the app handling this request."""
    return current_app.extensions[EXTENSION].settings
