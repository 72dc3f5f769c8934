"""vLLM's `LLM.embed` and `LLM.encode` for an engine started with runner="pooling"."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.pooling_outputs import EmbeddingRequestOutput, PoolingRequestOutput
from engine.pooling_params import PoolingParams


class PoolingMixin:
    """Mixed into `engine.llm.LLM` (which provides `llm_engine`, `_next_id` and `_run`)."""

    def encode(self, prompts, pooling_params: PoolingParams | Seq[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request=None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (`outputs.data`, a float32 tensor), in prompt order. Every
        prompt is checked before any runs: one bad prompt raises ValueError and nothing runs."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: the engine serves no LoRA adapters")
        if pooling_task not in (None, "embed", "encode"):
            raise ValueError(f"pooling_task={pooling_task!r} is not supported; only 'embed'")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = _params_per_prompt(pooling_params, len(prompts), truncate_prompt_tokens)
        engine = self.llm_engine
        if engine.pooler_config is None:
            raise ValueError("this LLM runs a generative model; embed with LLM(model, runner='pooling')")
        from engine.pooling import prepare_pooling

        prepared = []  # tokenized once, all checked before any is queued
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, token_ids = prepare_pooling(engine, prompt, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            prepared.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = []
        for prompt, p in zip(prepared, params):
            ids.append(str(self._next_id))
            self._next_id += 1
            engine.add_pooling_request(ids[-1], prompt, p)
        return self._run(ids, use_tqdm)

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`, a list of floats), in prompt order."""
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]


def _params_per_prompt(params, count: int, truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        params = [params or PoolingParams()] * count
    else:
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} pooling params for {count} prompts")
    if truncate_prompt_tokens is None:
        return params
    out = []
    for p in params:
        p = p.clone()
        p.truncate_prompt_tokens = truncate_prompt_tokens
        out.append(p)
    return out
