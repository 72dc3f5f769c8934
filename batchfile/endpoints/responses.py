"""OpenAI's objects for finished requests: the ``chat.completion`` and ``text_completion`` bodies
(choices, logprobs, usage) built from the engine's `RequestOutput`, and the lines of a batch's
output and error files."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import math
import time
import uuid
from types import SimpleNamespace

from batchfile.endpoints.responses_api import response_object
from batchfile.endpoints.tool_calls import with_tool_calls
from batchfile.request import RESPONSES_URL, ParsedRequest
from batchfile.token_text import hf_tokenizer, text_pieces, token_bytes, token_label


def _logprob(entry) -> float:
    """An engine `Logprob` (or a missing one) as a JSON number; JSON has no -inf."""
    value = -math.inf if entry is None else entry.logprob
    return -9999.0 if value == -math.inf or math.isnan(value) else float(value)


def _token_text(token_id: int) -> str:
    return f"token_id:{token_id}"  # without a tokenizer


def _pieces(choice, tokenizer, skip_special_tokens: bool) -> list[str]:
    if tokenizer is None:
        return [_token_text(t) for t in choice.token_ids]
    return text_pieces(tokenizer, list(choice.token_ids), choice.text, skip_special_tokens=skip_special_tokens)


def _bytes(tokenizer, token_id: int) -> list[int]:
    return list(_token_text(token_id).encode() if tokenizer is None else token_bytes(tokenizer, token_id))


def _label(tokenizer, token_id: int) -> str:
    return _token_text(token_id) if tokenizer is None else token_label(tokenizer, token_id)


def _best(top: dict, k: int) -> list:
    return sorted(top.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:k]


def _chat_logprobs(choice, k: int, tokenizer, skip_special_tokens: bool = True) -> dict:
    """Each token's own text (as OpenAI and vLLM: the same string it has among the top logprobs, not
    what it added to the content), its real bytes, and the `k` most likely tokens at its position."""
    content = []
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        alternatives = [
            {"token": _label(tokenizer, tid), "logprob": _logprob(lp), "bytes": _bytes(tokenizer, tid)}
            for tid, lp in _best(top, k)
        ]
        content.append(
            {
                "token": _label(tokenizer, token_id),
                "logprob": _logprob(top.get(token_id)),
                "bytes": _bytes(tokenizer, token_id),
                "top_logprobs": alternatives,
            }
        )
    return {"content": content, "refusal": None}


def _top_map(tokenizer, top: dict, k: int, sampled: int) -> dict:
    """OpenAI's completions `top_logprobs` at one position: the `k` most likely tokens and the sampled
    one (so k or k + 1 entries), each under its own key: two tokens that read alike (say two byte
    tokens) are never merged, the later one is keyed by its id."""
    chosen = _best(top, k)
    if sampled in top and all(tid != sampled for tid, _ in chosen):
        chosen.append((sampled, top[sampled]))
    out: dict[str, float] = {}
    for tid, lp in chosen:
        key = _label(tokenizer, tid)
        out[key if key not in out else _token_text(tid)] = _logprob(lp)
    return out


def _completion_logprobs(choice, k: int, tokenizer, skip_special_tokens: bool = True) -> dict:
    """`tokens`: each token's own text (as in `top_logprobs`); `text_offset`: where in the text each
    token's contribution starts (what it added, which a byte of a split character or a skipped special
    token leaves empty)."""
    pieces = _pieces(choice, tokenizer, skip_special_tokens)  # they join into the text
    tokens = [_label(tokenizer, t) for t in choice.token_ids]
    token_logprobs, top_logprobs, offsets = [], [], []
    offset = 0
    for token_id, top, piece in zip(choice.token_ids, choice.logprobs or [], pieces):
        # an echoed prompt's first token has no logprobs: null, as OpenAI
        token_logprobs.append(None if top is None else _logprob(top.get(token_id)))
        top_logprobs.append(None if top is None else _top_map(tokenizer, top, k, token_id))
        offsets.append(offset)
        offset += len(piece)
    n = len(offsets)
    return {
        "tokens": tokens[:n],
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _usage(output) -> dict:
    prompt = len(output.prompt_token_ids or [])
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": min(getattr(output, "num_cached_tokens", 0) or 0, prompt)},
    }


@functools.cache
def system_fingerprint(model: str) -> str:
    """Names the serving configuration (this build and the model), as OpenAI's `system_fingerprint`."""
    try:
        version = importlib.metadata.version("pagedbatch")
    except importlib.metadata.PackageNotFoundError:
        version = "dev"
    return "fp_" + hashlib.sha256(f"pagedbatch {version} {model}".encode()).hexdigest()[:10]


def chat_completion_body(
    output,
    *,
    model: str,
    logprobs: int | None = None,
    tokenizer=None,
    created: int | None = None,
    response_id: str | None = None,
    skip_special_tokens: bool = True,
) -> dict:
    """OpenAI ``chat.completion`` object for an engine `RequestOutput`.

    `logprobs`: the number of top logprobs requested (None: logprobs were not asked for).
    `tokenizer` (a HF tokenizer or a `ModelLimits`) turns token ids into text for logprobs.
    """
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = None
        if logprobs is not None and c.logprobs is not None:
            lp = _chat_logprobs(c, logprobs, tokenizer, skip_special_tokens)
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "finish_reason": c.finish_reason,
                "logprobs": lp,
            }
        )
    return {
        "id": response_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": system_fingerprint(model),
    }


def text_completion_body(
    output,
    *,
    model: str,
    logprobs: int | None = None,
    tokenizer=None,
    created: int | None = None,
    response_id: str | None = None,
    skip_special_tokens: bool = True,
) -> dict:
    """OpenAI ``text_completion`` object for an engine `RequestOutput`."""
    choices = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        lp = None
        if logprobs is not None and c.logprobs is not None:
            lp = _completion_logprobs(c, logprobs, tokenizer, skip_special_tokens)
        choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": lp})
    return {
        "id": response_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else int(created),
        "model": model,
        "choices": choices,
        "usage": _usage(output),
        "system_fingerprint": system_fingerprint(model),
    }


def response_body(request: ParsedRequest, output, *, tokenizer=None, created: int | None = None) -> dict:
    """The OpenAI body for a finished request, chat or text completion by the request's url."""
    build = chat_completion_body if request.is_chat else text_completion_body
    options = request.options or {}
    sp = request.sampling_params
    body = build(
        returned_output(request, output),
        model=request.model,
        logprobs=None if options.get("hide_logprobs") else sp.logprobs,
        tokenizer=tokenizer,
        created=created,
        skip_special_tokens=sp.skip_special_tokens,
    )
    body["usage"] = _usage(output)  # every best_of candidate was generated
    if options.get("echo"):
        _echo(body, output, options["echo"], sp.logprobs, tokenizer, sp.skip_special_tokens)
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


def returned_output(request: ParsedRequest, output):
    """`output` as the response returns it: with best_of, only the n best candidates."""
    n = (request.options or {}).get("best_of")
    return _best_of(output, n) if n else output


def _per_token(choice) -> float:
    """OpenAI's best_of rank: the choice's log probability per token."""
    return (choice.cumulative_logprob or 0.0) / max(len(choice.token_ids), 1)


def _best_of(output, n: int):
    """`output` with its `n` best candidates (highest logprob per token; ties: lower index), indexed 0..n-1."""
    ranked = sorted(output.outputs, key=lambda c: (-_per_token(c), c.index))[:n]
    kept = [dataclasses.replace(c, index=i) for i, c in enumerate(ranked)]
    return dataclasses.replace(output, outputs=kept)


def _echo(body: dict, output, prompt_text, logprobs: int | None, tokenizer, skip_special_tokens: bool) -> None:
    """Prepend the prompt to every choice's text and, with logprobs, its tokens' logprobs (the
    engine's prompt_logprobs) to the choice's. `prompt_text` is the prompt as sent, or True for a
    prompt sent as token ids (then its decoding)."""
    ids = list(output.prompt_token_ids)
    if prompt_text is True:
        prompt_text = (
            "" if tokenizer is None else hf_tokenizer(tokenizer).decode(ids, skip_special_tokens=skip_special_tokens)
        )
    prompt_lp = None
    if logprobs is not None and output.prompt_logprobs is not None:
        prompt = SimpleNamespace(token_ids=ids, logprobs=output.prompt_logprobs, text=prompt_text)
        prompt_lp = _completion_logprobs(prompt, logprobs, tokenizer, skip_special_tokens)
    for choice in body["choices"]:
        choice["text"] = prompt_text + choice["text"]
        if prompt_lp is not None and choice["logprobs"] is not None:
            own = choice["logprobs"]
            shift = len(prompt_text)
            choice["logprobs"] = {
                "tokens": prompt_lp["tokens"] + own["tokens"],
                "token_logprobs": prompt_lp["token_logprobs"] + own["token_logprobs"],
                "top_logprobs": prompt_lp["top_logprobs"] + own["top_logprobs"],
                "text_offset": prompt_lp["text_offset"] + [o + shift for o in own["text_offset"]],
            }


def batch_output_line(custom_id: str, body: dict, *, line_id: str | None = None, request_id: str | None = None) -> dict:
    """One line of an OpenAI batch output file (a successful request)."""
    return {
        "id": line_id or f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
        "error": None,
    }


def batch_error_line(
    custom_id: str | None,
    code: str,
    message: str,
    *,
    status_code: int | None = 400,
    line_id: str | None = None,
    request_id: str | None = None,
) -> dict:
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
