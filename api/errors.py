"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

from api.objects import Error, ErrorResponse
from store.errors import StoreError

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    507: "server_error",
}


class ApiError(StoreError):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param)
        self.status = status
        self.code = code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None):
    error = Error(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    return jsonify(ErrorResponse(error=error).model_dump(mode="json")), status


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(StoreError)
    def _store_error(exc: StoreError):
        response, status = error_response(exc.status, exc.message, exc.param, exc.code)
        response.headers.update(getattr(exc, "headers", None) or {})  # Retry-After, WWW-Authenticate
        return response, status

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = exc.description or exc.name
        if exc.code == 413:
            message = "Request entity too large: " + message
        response, status = error_response(exc.code or 500, message, None, exc.name.lower().replace(" ", "_"))
        allow = getattr(exc, "valid_methods", None)
        if status == 405 and allow:  # RFC 9110: a 405 says which methods the resource has
            response.headers["Allow"] = ", ".join(sorted(allow))
        return response, status

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        app.logger.exception("unhandled error")
        return error_response(500, "The server had an error while processing your request.", None, "server_error")
