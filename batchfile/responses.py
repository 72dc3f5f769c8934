"""OpenAI's objects for finished requests: the ``chat.completion`` and ``text_completion`` bodies
(choices, logprobs, usage) built from the engine's `RequestOutput`, and the lines of a batch's
output and error files."""

from __future__ import annotations

import math
import time
import uuid

from batchfile.request import RESPONSES_URL, ParsedRequest
from batchfile.responses_api import response_object
from batchfile.tool_calls import with_tool_calls


def _logprob(entry) -> float:
    """An engine `Logprob` (or a missing one) as a JSON number; JSON has no -inf."""
    value = -math.inf if entry is None else entry.logprob
    return -9999.0 if value == -math.inf or math.isnan(value) else float(value)


def _token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    decode = getattr(tokenizer, "token_text", None) or (lambda t: tokenizer.decode([t]))
    return decode(token_id)


def _chat_logprobs(choice, k: int, tokenizer) -> dict:
    content = []
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        text = _token_text(tokenizer, token_id)
        best = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:k]
        alternatives = []
        for tid, lp in best:
            alt = _token_text(tokenizer, tid)
            alternatives.append({"token": alt, "logprob": _logprob(lp), "bytes": list(alt.encode("utf-8"))})
        content.append({
            "token": text,
            "logprob": _logprob(top.get(token_id)),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": alternatives,
        })  # fmt: skip
    return {"content": content, "refusal": None}


def _completion_logprobs(choice, k: int, tokenizer) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(top.get(token_id)))
        best = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:k]
        top_logprobs.append({_token_text(tokenizer, tid): _logprob(lp) for tid, lp in best})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _usage(output) -> dict:
    prompt = len(output.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion_body(
    output, *, model: str, logprobs: int | None = None, tokenizer=None,
    created: int | None = None, response_id: str | None = None,
) -> dict:  # fmt: skip
    """OpenAI ``chat.completion`` object for an engine `RequestOutput`.

    `logprobs`: the number of top logprobs requested (None: logprobs were not asked for).
    `tokenizer` (a HF tokenizer or a `ModelLimits`) turns token ids into text for logprobs.
    """
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = _chat_logprobs(c, logprobs, tokenizer) if logprobs is not None and c.logprobs is not None else None
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": lp,
        })  # fmt: skip
    return {
        "id": response_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": None,
    }


def text_completion_body(
    output, *, model: str, logprobs: int | None = None, tokenizer=None,
    created: int | None = None, response_id: str | None = None,
) -> dict:  # fmt: skip
    """OpenAI ``text_completion`` object for an engine `RequestOutput`."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = _completion_logprobs(c, logprobs, tokenizer) if logprobs is not None and c.logprobs is not None else None
        choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp})
    return {
        "id": response_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": None,
    }


def response_body(request: ParsedRequest, output, *, tokenizer=None, created: int | None = None) -> dict:
    """The OpenAI body for a finished request, chat or text completion by the request's url."""
    build = chat_completion_body if request.is_chat else text_completion_body
    body = build(
        output,
        model=request.model,
        logprobs=request.sampling_params.logprobs,
        tokenizer=tokenizer,
        created=created,
    )
    options = request.options or {}
    if options.get("copies"):  # n greedy choices: one sample, n identical choices
        one = body["choices"][0]
        body["choices"] = [{**one, "index": i} for i in range(options["copies"])]
        usage = body["usage"]
        usage["completion_tokens"] *= options["copies"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if options.get("tools") and request.is_chat:
        body["choices"] = [with_tool_calls(c, options["tools"]) for c in body["choices"]]
    if request.url == RESPONSES_URL:
        return response_object(body, options.get("responses") or {}, cached_tokens=output.num_cached_tokens or 0)
    return body


def batch_output_line(custom_id: str, body: dict, *, line_id: str | None = None, request_id: str | None = None) -> dict:
    """One line of an OpenAI batch output file (a successful request)."""
    return {
        "id": line_id or f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def batch_error_line(
    custom_id: str | None, code: str, message: str, *, status_code: int | None = 400,
    line_id: str | None = None, request_id: str | None = None,
) -> dict:  # fmt: skip
    """One line of an OpenAI batch error file.

    With a `status_code` (a request the API rejected, as OpenAI reports a 400) the error is the
    response body; with ``status_code=None`` (cancelled, expired, engine failure) ``response`` is
    null and ``error`` holds the code and message.
    """
    line = {"id": line_id or f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id}
    if status_code is None:
        line.update(response=None, error={"code": code, "message": message})
        return line
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    line.update(
        response={
            "status_code": status_code,
            "request_id": request_id or f"req_{uuid.uuid4().hex}",
            "body": {"error": error},
        },
        error=None,
    )
    return line
