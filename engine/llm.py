"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat


class LLM:
    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True, seed: int = 0,
                 **kwargs):
        self.llm_engine = LLMEngine(
            model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, seed=seed, **kwargs,
        )
        self._next_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is checked before any runs,
        so one bad prompt raises ValueError and nothing is half done."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        engine = self.llm_engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                p.validate()
                engine.check_request(engine.tokenize(prompt)[1], p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(str(self._next_id))
            self._next_id += 1
            engine.add_request(ids[-1], prompt, p)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        prompts = [{"prompt_token_ids": encode_chat(tokenizer, conv)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
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
