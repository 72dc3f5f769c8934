"""Errors of the job store, each with the HTTP status and error code the API answers with."""

from __future__ import annotations


class StoreError(Exception):
    status = 400
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class NotFound(StoreError):
    status = 404
    code = "not_found"


class Conflict(StoreError):
    status = 409
    code = "conflict"


class TooLarge(StoreError):
    status = 413
    code = "payload_too_large"
