"""How a request line fails: the error codes, the per-line `LineError`, and `InputTooLarge`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Every code is a problem with the request itself (an HTTP 400 in OpenAI's terms).
LINE_TOO_LONG = "line_too_long"
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
INVALID_CUSTOM_ID = "invalid_custom_id"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_METHOD = "invalid_method"
INVALID_URL = "invalid_url"
MISSING_MODEL = "missing_model"
MODEL_NOT_FOUND = "model_not_found"
INVALID_MESSAGES = "invalid_messages"
INVALID_PROMPT = "invalid_prompt"
INVALID_PARAMETER = "invalid_parameter"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CHAT_TEMPLATE_ERROR = "chat_template_error"
OUTPUT_BUDGET_EXCEEDED = "output_budget_exceeded"  # n x max_tokens x logprobs over the configured bound
DUPLICATE_KEY = "duplicate_key"  # a JSON object naming one key twice
MODEL_MISMATCH = "model_mismatch"  # the native API: a line's body.model is not the job's model
REQUEST_ERROR_CODES = frozenset(
    {
        LINE_TOO_LONG,
        INVALID_UTF8,
        INVALID_JSON,
        INVALID_REQUEST,
        INVALID_CUSTOM_ID,
        DUPLICATE_CUSTOM_ID,
        INVALID_METHOD,
        INVALID_URL,
        MISSING_MODEL,
        MODEL_NOT_FOUND,
        INVALID_MESSAGES,
        INVALID_PROMPT,
        INVALID_PARAMETER,
        UNSUPPORTED_PARAMETER,
        CONTEXT_LENGTH_EXCEEDED,
        CHAT_TEMPLATE_ERROR,
        OUTPUT_BUDGET_EXCEEDED,
        DUPLICATE_KEY,
        MODEL_MISMATCH,
    }
)


@dataclass
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None  # the field at fault (OpenAI's error `param`), when one is

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class InvalidLine(Exception):
    """Raised while a line is validated; the parser turns it into that line's `LineError`."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class InputTooLarge(ValueError):
    """The input has more lines or bytes than allowed (HTTP 413). `actual` is a lower bound."""

    def __init__(self, what: str, limit: int, actual: int):
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"input has more than {limit:,} {what} (read {actual:,} so far)")
