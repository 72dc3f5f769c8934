"""vLLM's `LLM.classify` and `LLM.score` for an engine started with runner="pooling".

`score(text_1, texts_2)` pairs one text with each of several (or two equal-length lists pairwise). On a
sequence-classification model (a cross-encoder) each pair is one input, encoded with the tokenizer's
pair template (its segment ids too) and scored by the head (through the model's activation); on an
embedding model the score is the cosine of the two texts' embeddings."""

from __future__ import annotations

import torch.nn.functional as F

from engine.params.pooling_params import PoolingParams
from engine.params.scoring_outputs import ClassificationRequestOutput, ScoringOutput, ScoringRequestOutput


class ScoringMixin:
    """Mixed into `engine.entrypoints.llm.LLM` (with `engine.entrypoints.llm_pooling.PoolingMixin`'s `encode`)."""

    def classify(
        self,
        prompts,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`: softmax over the labels, sigmoid for
        one; `pooling_params.use_activation=False`: the logits), in prompt order."""
        outputs = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="classify",
            tokenization_kwargs=tokenization_kwargs,
        )
        id2label = getattr(self.llm_engine.model_config, "id2label", {}) or {}
        return [ClassificationRequestOutput.from_base(o, id2label) for o in outputs]

    def score(
        self,
        data_1,
        data_2,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair: `data_1` one text and `data_2` one or many, or two lists of one length."""
        firsts, seconds = score_pairs(data_1, data_2)
        engine = self.llm_engine
        if getattr(engine.model_config, "classifier", False):
            prompts = [
                pair_prompt(engine.tokenizer, a, b, engine.max_model_len, truncate_prompt_tokens)
                for a, b in zip(firsts, seconds)
            ]
            outputs = self.encode(
                prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="score"
            )
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                for o in outputs
            ]
        unique = list(dict.fromkeys(firsts + seconds))
        outputs = self.encode(
            unique,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            pooling_task="embed",
            tokenization_kwargs=tokenization_kwargs,
        )
        by_text = dict(zip(unique, outputs))
        results = []
        for a, b in zip(firsts, seconds):
            ea, eb = by_text[a], by_text[b]
            cos = F.cosine_similarity(ea.outputs.data.float()[None], eb.outputs.data.float()[None])[0]
            results.append(
                ScoringRequestOutput(
                    f"{ea.request_id}-{eb.request_id}",
                    ScoringOutput(float(cos)),
                    ea.prompt_token_ids + eb.prompt_token_ids,
                )
            )
        return results


def score_pairs(data_1, data_2) -> tuple[list[str], list[str]]:
    """vLLM's pairing: 1 to 1, 1 to N, or N to N."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not all(isinstance(t, str) for t in firsts + seconds):
        raise ValueError("score takes texts (strings)")
    if not firsts or not seconds:
        raise ValueError("score needs at least one text on each side")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(
            f"score pairs one text with many, or two lists of one length; got {len(firsts)} and {len(seconds)}"
        )
    return firsts, seconds


def pair_prompt(tokenizer, first: str, second: str, max_model_len: int, truncate: int | None = None) -> dict:
    """The pair's token ids and segment ids by the tokenizer's pair template. Cut to `truncate`
    tokens (-1: the context) as the tokenizer cuts pairs (longest first); otherwise a pair longer
    than the context is refused when it is checked."""
    kwargs = {}
    if truncate is not None:
        kwargs = {"truncation": True, "max_length": max_model_len if truncate == -1 else truncate}
    enc = tokenizer(first, second, **kwargs)
    prompt = {"prompt_token_ids": list(enc["input_ids"])}
    if "token_type_ids" in enc:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt
