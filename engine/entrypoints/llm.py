"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.beam.runner import run_beam_search
from engine.beam.search import BeamSearchOutput, BeamSearchParams
from engine.core.llm_engine import LLMEngine, Prompt
from engine.core.request_checks import check_priority
from engine.entrypoints.chat_prompt import render_conversation
from engine.entrypoints.llm_args import engine_kwargs
from engine.entrypoints.llm_metrics import Metric, engine_metrics
from engine.entrypoints.llm_pooling import PoolingMixin
from engine.entrypoints.llm_scoring import ScoringMixin
from engine.exceptions import VLLMValidationError
from engine.lora.slots import lora_per_prompt
from engine.multimodal.chat import chat_image_prompt
from engine.multimodal.engine_requests import prepare_request
from engine.multimodal.request import has_images
from engine.params.outputs import RequestOutput
from engine.params.sampling_params import SamplingParams


class LLM(PoolingMixin, ScoringMixin):
    """vLLM's `LLM`. Keyword arguments are `EngineConfig` options or vLLM's own; see
    `engine.entrypoints.llm_args` for the vLLM ones that are no-ops here and the values that are refused."""

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        seed: int | None = 0,
        **kwargs,
    ):
        self.llm_engine = LLMEngine(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            **engine_kwargs(kwargs),
        )
        self._next_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (unless generation_config="vllm"),
        used by `generate` and `chat` when no params are given."""
        return SamplingParams(**self.llm_engine.default_sampling_values)

    def reset_prefix_cache(self) -> bool:
        """Forget cached prompt blocks; False (nothing done) while requests hold blocks."""
        return self.llm_engine.block_manager.reset_prefix_cache()

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request=None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search, its beams run in the engine (see `engine.beam.runner`); one output per prompt.
        `concurrency_limit`: at most this many prompts searched at once (vLLM's; the outputs are the same)."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported by beam_search")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        token_prompts = [self.llm_engine.tokenize(p)[1] for p in prompts]
        if concurrency_limit is None:
            return run_beam_search(self, token_prompts, params)
        if not isinstance(concurrency_limit, int) or concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
        return [
            out
            for i in range(0, len(token_prompts), concurrency_limit)
            for out in run_beam_search(self, token_prompts[i : i + concurrency_limit], params)
        ]

    def get_metrics(self) -> list[Metric]:
        """vLLM's metric names: token and request counters, running/waiting gauges, KV cache use."""
        return engine_metrics(self.llm_engine)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        priority: int | Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is checked before any runs,
        so one bad prompt raises ValueError and nothing is half done. `priority` and `lora_request`
        (an `engine.LoRARequest`): one for every prompt, or a list with one per prompt (as vLLM)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        engine = self.llm_engine
        priority = _priorities(priority, len(prompts), engine.config.scheduling_policy)
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = lora_per_prompt(engine, lora_request, len(prompts))
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                prepared.append(prepare_request(engine, prompt, p))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
        ids = []
        for prompt, p, rank, lora, ready in zip(prompts, params, priority, loras, prepared):
            ids.append(str(self._next_id))
            self._next_id += 1
            engine.add_prepared_request(ids[-1], prompt, p, ready, priority=rank, lora_request=lora)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = []
        for conversation in conversations:
            if has_images(conversation):
                prompts.append(
                    chat_image_prompt(
                        self.llm_engine,
                        conversation,
                        chat_template=chat_template,
                        tools=tools,
                        chat_template_kwargs=chat_template_kwargs,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                    )
                )
                continue
            text = render_conversation(
                tokenizer,
                conversation,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
            )
            prompts.append({"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _params_per_prompt(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise VLLMValidationError(
                f"The lengths of prompts ({count}) and sampling_params ({len(params)}) must be the same."
            )
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.request_id in wanted:
                        results[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in wanted - results.keys():
                engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [results[i] for i in ids]


def _priorities(priority, count: int, policy: str) -> list[int]:
    """One priority per prompt (0 when none are given), all checked before any request is added: under
    vLLM's default first-come-first-served policy, priorities other than 0 are refused."""
    if priority is None:
        return [0] * count
    if isinstance(priority, int) and not isinstance(priority, bool):
        priority = [priority] * count
    elif isinstance(priority, str | bytes | dict) or not isinstance(priority, Seq):
        raise VLLMValidationError(f"priority must be an integer or a list of integers, got {priority!r:.40}")
    priority = list(priority)
    if len(priority) != count:
        raise VLLMValidationError(f"The lengths of prompts ({count}) and priority ({len(priority)}) must be the same.")
    for value in priority:
        check_priority(value, policy)
    return priority
