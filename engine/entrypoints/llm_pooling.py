"""vLLM's `LLM.embed` and `LLM.encode` for an engine started with runner="pooling"."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.params.pooling_outputs import EmbeddingRequestOutput, PoolingRequestOutput
from engine.params.pooling_params import PoolingParams


class PoolingMixin:
    """Mixed into `engine.entrypoints.llm.LLM` (which provides `llm_engine`, `_next_id` and `_run`)."""

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (`outputs.data`, a float32 tensor), in prompt order. Every
        prompt is checked before any runs: one bad prompt raises ValueError and nothing runs.
        `tokenization_kwargs` (vLLM's): `truncate_prompt_tokens`, `truncation_side`, or
        `truncation=True` (cut to `max_length`, by default the context)."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: the engine serves no LoRA adapters")
        if pooling_task not in (None, "embed", "encode", "classify", "score"):
            raise ValueError(f"pooling_task={pooling_task!r} is not supported; use embed, classify or score")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        truncation = _truncation(tokenization_kwargs, truncate_prompt_tokens)
        if pooling_task in ("classify", "score"):
            truncation = {**truncation, "task": pooling_task}
        params = _params_per_prompt(pooling_params, len(prompts), truncation)
        engine = self.llm_engine
        if engine.pooler_config is None:
            raise ValueError("this LLM runs a generative model; embed with LLM(model, runner='pooling')")
        from engine.pooling.requests import prepare_pooling

        prepared = []  # tokenized once, all checked before any is queued
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, token_ids = prepare_pooling(engine, prompt, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            prepared.append({"prompt": text, "prompt_token_ids": token_ids})
            if isinstance(prompt, dict) and "token_type_ids" in prompt:  # a cross-encoder's pair
                prepared[-1]["token_type_ids"] = prompt["token_type_ids"]
        ids = []
        for prompt, p in zip(prepared, params):
            ids.append(str(self._next_id))
            self._next_id += 1
            engine.add_pooling_request(ids[-1], prompt, p)
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats), in prompt order."""
        outputs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="embed",
            tokenization_kwargs=tokenization_kwargs,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]


_TOKENIZATION_KWARGS = frozenset({"truncate_prompt_tokens", "truncation_side", "truncation", "max_length"})


def _truncation(kwargs: dict | None, truncate_prompt_tokens: int | None) -> dict:
    """The PoolingParams fields that the call's truncation arguments set (vLLM's
    `tokenization_kwargs`, or the older `truncate_prompt_tokens` argument)."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - _TOKENIZATION_KWARGS)
    if unknown:
        raise ValueError(f"tokenization_kwargs {unknown} are not supported; supported: {sorted(_TOKENIZATION_KWARGS)}")
    out = {}
    truncation = kwargs.get("truncation")
    if truncation in (True, "longest_first"):
        out["truncate_prompt_tokens"] = kwargs.get("max_length", -1)
    elif truncation not in (None, False, "do_not_truncate"):
        raise ValueError(f"truncation={truncation!r} is not supported; use True or False")
    elif "max_length" in kwargs:
        raise ValueError("max_length needs truncation=True")
    if "truncate_prompt_tokens" in kwargs:
        out["truncate_prompt_tokens"] = kwargs["truncate_prompt_tokens"]
    if truncate_prompt_tokens is not None:
        out["truncate_prompt_tokens"] = truncate_prompt_tokens
    if "truncation_side" in kwargs:
        out["truncation_side"] = kwargs["truncation_side"]
    return out


def _params_per_prompt(params, count: int, truncation: dict) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        params = [params or PoolingParams()] * count
    else:
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} pooling params for {count} prompts")
    if not truncation:
        return params
    out = []
    for p in params:
        p = p.clone()
        for name, value in truncation.items():
            setattr(p, name, value)
        out.append(p)
    return out
