"""Prefill-only requests that end in a pooled vector instead of sampled tokens.

A pooling request is one sequence that the scheduler treats like any other prompt (chunked
prefill, prefix caching, preemption, sharing steps with generation). Each step's hidden
states of its new tokens are folded into its `PoolingState`; when the last prompt token
has been computed, the vector is finished (Matryoshka truncation, L2 normalization), the
sequence leaves the scheduler and its KV blocks go back to the pool at once.

Mean and CLS pooling need the hidden states of every token, which a cached prefix skips,
so those requests never take prefix-cache hits (they still fill the cache); last-token
pooling takes them like generation does."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.core.block_manager import cdiv
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence
from engine.hf.sentence_transformers_config import PoolerConfig
from engine.params.pooling_outputs import PoolingOutput, PoolingRequestOutput
from engine.params.pooling_params import PoolingParams
from engine.params.pooling_truncation import cut, kept_tokens
from engine.params.sampling_params import SamplingParams
from engine.pooling import forward as pooling_forward
from engine.pooling import st_dense
from engine.pooling.classify_state import CLASSIFY_TASKS, ClassifyState

# The sampling params a pooling sequence carries for the scheduler's sake: nothing is sampled.
_PREFILL_ONLY = SamplingParams(max_tokens=1, detokenize=False)


class PoolingState:
    classifies = False  # see engine.pooling.classify_state

    def __init__(
        self, method: str, params: PoolingParams, normalize: bool, head=None, token_type_ids: list[int] | None = None
    ):
        self.method = method
        self.params = params
        self.normalize = normalize
        self.head = head  # sentence-transformers' Dense layers (engine.pooling.st_dense), or None
        self.token_type_ids = token_type_ids  # an encoder's segment ids (None: all 0)
        self.needs_every_token = method != "LAST"
        self._acc: torch.Tensor | None = None  # MEAN: running sum; CLS: the first token's state
        self.vector: torch.Tensor | None = None

    def needed_rows(self, start: int, n: int, total: int) -> slice:
        """Which rows of the chunk at prompt positions [start, start + n) pooling reads."""
        if self.method == "MEAN":
            return slice(0, n)
        if self.method == "CLS":
            return slice(0, 1 if start == 0 else 0)
        return slice(n - 1, n) if start + n == total else slice(n, n)

    def absorb(self, hidden: torch.Tensor, start: int, total: int) -> None:
        """Fold in the hidden states of prompt positions [start, start + len(hidden))."""
        n = hidden.shape[0]
        self.absorb_rows(hidden[self.needed_rows(start, n, total)], start, n, total)

    def absorb_rows(self, rows: torch.Tensor, start: int, n: int, total: int) -> None:
        """Fold in `rows`, the `needed_rows` of the chunk at prompt positions [start, start + n)."""
        if self.method == "MEAN":
            part = rows.float().sum(0)
            self._acc = part if start == 0 else self._acc + part  # start 0: first pass or recompute
        elif self.method == "CLS" and start == 0:
            self._acc = rows[0].float()
        if start + n == total:
            if self.method == "LAST":
                pooled = rows[-1].float()
            elif self.method == "MEAN":
                pooled = self._acc / total
            else:
                pooled = self._acc
            self.vector = self._finish(pooled)
            self._acc = None

    def _finish(self, pooled: torch.Tensor) -> torch.Tensor:
        pooled = st_dense.apply(self.head, pooled)
        if self.params.dimensions is not None:
            pooled = pooled[: self.params.dimensions]
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()


def has_pooling(batch: ScheduledBatch) -> bool:
    return any(s.pooling is not None for s in batch.seqs)


def forward_with_pooling(runner, batch: ScheduledBatch, extra_rows: list[int]):
    """One forward pass for a batch holding pooling sequences: folds their hidden states into
    their states and returns (logits of the generation sequences that sample, hidden states of
    `extra_rows` or None), as `ModelRunner.execute` does for a batch without them."""
    if getattr(runner, "is_encoder", False):
        runner.run(batch)  # engine.runner.encoder_runner: pooling only, whole inputs
        return None, None
    if not extra_rows and pooling_forward.applies(runner, batch):
        pooling_forward.run(runner, batch)  # only pooling prompts from position 0: nothing samples
        return None, None
    input_ids, inputs, _ = runner.prepare(batch)
    with torch.no_grad():
        hidden = runner.model(input_ids, inputs)
        sample_rows, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if seq.pooling is not None:
                seq.pooling.absorb(hidden[row : row + n], start, len(seq))
            elif start + n == len(seq):
                sample_rows.append(row + n - 1)
            row += n
        logits = runner.model.compute_logits(hidden[sample_rows]) if sample_rows else None
        extra = hidden[extra_rows] if extra_rows else None
    return logits, extra


def pooled_sequences(batch: ScheduledBatch) -> list[Sequence]:
    """The batch's pooling sequences whose vector is done (call after the step's bookkeeping)."""
    return [s for s in batch.seqs if s.pooling is not None and s.pooling.vector is not None]


def check_pooling_request(engine, ids: list[int], params: PoolingParams, config: PoolerConfig) -> None:
    """The input fits: the engine's context, which a sentence-transformers directory's
    `max_seq_length` caps (as vLLM; sentence-transformers would silently truncate), its pool."""
    if engine.pooler_config is None:
        raise ValueError("this model runs as a generative model; start it with runner='pooling' to embed")
    if not ids:
        raise ValueError("the input is empty")
    limit = engine.max_model_len
    if len(ids) > limit:
        raise ValueError(
            f"the input has {len(ids)} tokens, more than the model's context of {limit} tokens "
            f"(set truncate_prompt_tokens to truncate it: -1 keeps the first {limit})"
        )
    classifier = getattr(engine.model_config, "classifier", False)
    if params.task in CLASSIFY_TASKS and not classifier:
        raise ValueError(
            f"this model has no classification head: it cannot {params.task} "
            "(a *ForSequenceClassification model can; an embedding model scores with LLM.score)"
        )
    if params.task not in CLASSIFY_TASKS and classifier:
        raise ValueError(
            "this model is a classifier (a sequence-classification head): use classify or score, not embed"
        )
    if params.dimensions is not None:
        config.check_dimensions(params.dimensions, config.dense_output_size or engine.model_config.hidden_size)
    blocks = cdiv(len(ids), engine.config.block_size)
    if blocks > engine.block_manager.num_blocks:
        raise ValueError(f"the input needs {blocks} KV blocks but the pool has only {engine.block_manager.num_blocks}")


def prepare_pooling(engine, prompt, params: PoolingParams) -> tuple[str | None, list[int]]:
    """The input's text and token ids (the model's default sentence-transformers prompt put
    before text, lowercased where the model says `do_lower_case`, then cut as asked:
    `engine.params.pooling_truncation`), checked; raises ValueError for one never served."""
    params.validate()
    config = engine.pooler_config
    if isinstance(prompt, str) and config is not None:
        prompt = config.default_prompt + prompt
        if config.do_lower_case:
            prompt = prompt.lower()
    text, ids = engine.tokenize(prompt)
    keep = kept_tokens(params.truncate_prompt_tokens, engine.max_model_len)
    if keep is not None and len(ids) > keep:
        given_ids = isinstance(prompt, dict) and "prompt_token_ids" in prompt
        plain = None if given_ids else engine.tokenizer(text, add_special_tokens=False).input_ids
        ids = cut(ids, keep, params.truncation_side, plain)
    check_pooling_request(engine, ids, params, config)
    return text, ids


def pooling_request(
    engine, seq_ids: Iterator[int], request_id: str, prompt, params: PoolingParams | None, arrival: float | None
):
    """(text, token ids, sequences) of one pooling request: one sequence per input. A list of
    inputs (one batch line's) becomes one request whose output stacks their vectors; every input
    is checked before any is queued."""
    params = params or PoolingParams()
    config = engine.pooler_config
    many = isinstance(prompt, list)
    prepared = []
    for i, p in enumerate(prompt if many else [prompt]):
        try:
            prepared.append(prepare_pooling(engine, p, params))
        except ValueError as exc:
            raise ValueError(f"input {i}: {exc}" if many else str(exc)) from exc
    if not prepared:
        raise ValueError("a pooling request needs at least one input")
    normalize = config.normalize if params.normalize is None else params.normalize
    arrival = arrival or time.time()
    seqs = []
    for i, (p, (_, ids)) in enumerate(zip(prompt if many else [prompt], prepared)):
        seq = Sequence(next(seq_ids), request_id, i, ids, _PREFILL_ONLY, arrival)
        types = p.get("token_type_ids") if isinstance(p, dict) else None
        if types is not None and len(types) != len(ids):
            raise ValueError(f"token_type_ids has {len(types)} entries for {len(ids)} tokens")
        if params.task in CLASSIFY_TASKS:
            seq.pooling = ClassifyState(
                params, engine.model_config.num_labels, engine.model_config.score_activation, types
            )
        else:
            seq.pooling = PoolingState(config.method, params, normalize, getattr(engine, "pooling_head", None), types)
        seqs.append(seq)
    if many:
        return None, [ids for _, ids in prepared], seqs
    return prepared[0][0], prepared[0][1], seqs


def num_prompt_tokens(ids: list) -> int:
    """Tokens of a request's prompt: one list of ids, or (a multi-input pooling request) a list of them."""
    return sum(map(len, ids)) if ids and isinstance(ids[0], list) else len(ids)


def pooling_output(req) -> PoolingRequestOutput:
    """`outputs.data`: the vector, or for a multi-input request the vectors stacked [inputs, dim]."""
    seqs = sorted(req.seqs, key=lambda s: s.index)
    many = isinstance(req.prompt_token_ids[0], list)
    data = torch.stack([s.pooling.vector for s in seqs]) if many else seqs[0].pooling.vector
    return PoolingRequestOutput(
        req.request_id,
        PoolingOutput(data),
        req.prompt_token_ids,
        num_cached_tokens=sum(s.num_cached_tokens for s in seqs),
        prompt=req.prompt,
    )
