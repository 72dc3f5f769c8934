"""A validated line as the engine runs it and the row its output makes: a completion or chat line is
one generation request; an embeddings line is one pooling request holding all of its inputs."""

from __future__ import annotations

from batchfile.request import ParsedRequest
from engine.pooling_params import PoolingParams
from store.results.embedding_rows import embedding_row
from store.results.rows import completed_row


def engine_request(request_id: str, req: ParsedRequest) -> tuple:
    """(request id, prompt, params) for `EngineHost.submit_many`."""
    if req.inputs is not None:
        dimensions = (req.embedding_options or {}).get("dimensions")
        return request_id, [{"prompt_token_ids": ids} for ids in req.inputs], PoolingParams(dimensions=dimensions)
    return request_id, {"prompt_token_ids": req.prompt_token_ids}, req.sampling_params


def add_to_engine(engine, request_id: str, req: ParsedRequest) -> None:
    """Into an `LLMEngine` directly (the offline path)."""
    _, prompt, params = engine_request(request_id, req)
    if req.inputs is not None:
        engine.add_pooling_request(request_id, prompt, params)
    else:
        engine.add_request(request_id, prompt, params)


def result_row(req: ParsedRequest, output, **kwargs) -> dict:
    """The completed row of a finished request (see `store.results.rows.completed_row`)."""
    return (embedding_row if req.inputs is not None else completed_row)(req, output, **kwargs)
