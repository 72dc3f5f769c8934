"""A validated request line, ready for the engine, and the endpoints a line may target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
RESPONSES_URL = "/v1/responses"
SCORE_URL = "/v1/score"  # vLLM's: text_1 against text_2 (batchfile.endpoints.scoring)
RERANK_URL = "/v1/rerank"  # vLLM's (Jina/Cohere shape): query, documents, top_n
SCORING_URLS = (SCORE_URL, RERANK_URL)
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL, SCORE_URL, RERANK_URL)
MESSAGE_URLS = (CHAT_URL, RESPONSES_URL)  # a conversation through the chat template


@dataclass
class ParsedRequest:
    line: int
    custom_id: str
    url: str
    model: str  # the name of the model that serves it (the forced model's name when one is forced)
    prompt_token_ids: list[int]
    sampling_params: Any  # engine.SamplingParams
    body: dict  # the line's body as uploaded (before job defaults)
    # /v1/embeddings lines (prompt_token_ids and sampling_params are then empty and None): every
    # input's token ids, and the options {"encoding_format", "dimensions"} (batchfile.endpoints.embeddings);
    # /v1/score and /v1/rerank lines: the pairs' (or the texts') ids and their options (batchfile.endpoints.scoring)
    inputs: list[list[int]] | None = None
    embedding_options: dict | None = None
    # how to shape the response: "copies" (n identical greedy choices), "tools" (tool_calls.read_tools)
    options: dict = field(default_factory=dict)
    # a chat line with images: their URLs (data: or http(s), fetched by the worker) and the rendered prompt
    # text, which the worker expands and tokenizes as the model's processor does (prompt_token_ids hold
    # one marker per image)
    images: list[str] | None = None
    prompt_text: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.url in MESSAGE_URLS
