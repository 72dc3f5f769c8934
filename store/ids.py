"""Unguessable public ids: a prefix and 24 random url-safe characters (~143 bits)."""

from __future__ import annotations

import secrets
import string

_ALPHABET = string.ascii_letters + string.digits + "-_"


def new_id(prefix: str, length: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(length))


def job_id() -> str:
    return new_id("batch_")


def file_id() -> str:
    return new_id("file-")
