"""A validated line as the engine runs it and the row its output makes: a completion or chat line is
one generation request; an embeddings line is one pooling request holding all of its inputs."""

from __future__ import annotations

from batchfile.request import SCORING_URLS, ParsedRequest
from engine.params.pooling_params import PoolingParams
from store.results.embedding_rows import embedding_row
from store.results.rows import completed_row
from store.results.score_rows import score_row
from workers.host import lora_adapters


def engine_request(request_id: str, req: ParsedRequest) -> tuple:
    """(request id, prompt, params) for `EngineHost.submit_many`."""
    if req.url in SCORING_URLS:  # a cross-encoder's pairs (with their segment ids), or an embedder's texts
        options = req.embedding_options
        if options["mode"] == "cross":
            types = options.get("token_type_ids") or [None] * len(req.inputs)
            prompts = [
                {"prompt_token_ids": ids, **({"token_type_ids": t} if t else {})} for ids, t in zip(req.inputs, types)
            ]
            return request_id, prompts, PoolingParams(task="score")
        return request_id, [{"prompt_token_ids": ids} for ids in req.inputs], PoolingParams()
    if req.inputs is not None:
        dimensions = (req.embedding_options or {}).get("dimensions")
        return request_id, [{"prompt_token_ids": ids} for ids in req.inputs], PoolingParams(dimensions=dimensions)
    if req.images:  # expanded and tokenized by the engine as the model's processor does; URLs fetched here
        prompt = {"prompt": req.prompt_text, "add_special_tokens": False, "multi_modal_data": {"image": req.images}}
    else:
        prompt = {"prompt_token_ids": req.prompt_token_ids}
    lora = lora_adapters.request_for(req.model)
    if lora is not None:  # a line naming a LoRA adapter: the base model runs it with the adapter
        prompt["lora_request"] = lora
    return request_id, prompt, req.sampling_params


def add_to_engine(engine, request_id: str, req: ParsedRequest) -> None:
    """Into an `LLMEngine` directly (the offline path)."""
    _, prompt, params = engine_request(request_id, req)
    if req.inputs is not None:
        engine.add_pooling_request(request_id, prompt, params)
    else:
        engine.add_request(request_id, prompt, params)


def result_row(req: ParsedRequest, output, **kwargs) -> dict:
    """The completed row of a finished request (see `store.results.rows.completed_row`)."""
    if req.url in SCORING_URLS:
        return score_row(req, output, **kwargs)
    return (embedding_row if req.inputs is not None else completed_row)(req, output, **kwargs)
